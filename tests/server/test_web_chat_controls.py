"""The chat page's controls in a real browser (support/browser.py) against a real ``kvpark
serve`` with one slot: the settings become the request's fields, a queued answer shows its place
and then streams, Stop ends the request on the server (its cells come back) and Regenerate asks
again in its place. test_web_pages.py has the parks, the pool view and the API key.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from selenium.webdriver.common.by import By

from support.browser import chromium, console_errors, require_browser, wait_for
from support.servers import Server, serve_for_module
from support.web_pages import (
    WATCH_LABELS,
    chat_in_thread,
    open_page,
    record_of,
    send,
    set_settings,
    stored_chats,
    wait_answered,
)

# the page's requests as it sends them: fetch wrapped before the page's modules call it
RECORD_BODIES = """
window.kvparkBodies = [];
const fetchFirst = window.fetch;
window.fetch = (url, options) => {
  if (String(url).endsWith("/v1/chat/completions")) window.kvparkBodies.push(options.body);
  return fetchFirst(url, options);
};
"""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    require_browser()
    yield from serve_for_module("--parallel", "1")


@pytest.fixture(scope="module")
def driver(server: Server) -> Iterator[Any]:
    with chromium() as browser:
        open_page(browser, f"{server.base_url}/")
        yield browser


def status(driver: Any) -> str:
    return str(driver.execute_script(
        "return document.querySelector('.msg.assistant:last-of-type .status .label')?.textContent"
    ))  # fmt: skip


def new_chat(driver: Any) -> None:
    driver.find_element(By.CSS_SELECTOR, ".tab-new").click()
    wait_for(driver, "a new empty chat", lambda d: d.find_elements(By.CSS_SELECTOR, ".empty-state"))


def test_the_settings_become_the_request(driver: Any) -> None:
    new_chat(driver)
    set_settings(driver, system="Answer in French.", temperature="0.3", top_p="0.9",
                 max_tokens="8", seed="42", json="on")  # fmt: skip
    driver.execute_script(RECORD_BODIES)
    send(driver, "Name a colour.")
    record = record_of(wait_answered(driver, 1))
    (body,) = [json.loads(b) for b in driver.execute_script("return window.kvparkBodies")]
    assert body["messages"] == [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Name a colour."},
    ]
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (
        0.3,
        0.9,
        8,
        42,
    )
    assert body["response_format"] == {"type": "json_object"}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert record["usage"]["completion_tokens"] <= 8
    assert not console_errors(driver)


def test_a_queued_answer_shows_its_place_then_streams(server: Server, driver: Any) -> None:
    new_chat(driver)
    set_settings(driver, max_tokens="16", json="off")
    holder = chat_in_thread(server, "Count to a thousand.", 2000)  # takes the one slot
    assert holder.started.wait(60)
    driver.execute_script(WATCH_LABELS)
    send(driver, "Say hello.")
    wait_for(driver, "the answer queued", lambda d: status(d).startswith("queued - place "))
    assert status(driver) == "queued - place 1"
    holder.stop()  # its slot comes back: the answer is admitted
    answer = wait_answered(driver, 1)
    labels: list[str] = driver.execute_script("return window.kvparkLabels")
    assert labels.index("queued - place 1") < labels.index("streaming"), labels
    assert answer.find_element(By.CSS_SELECTOR, ".md").text.strip()
    assert holder.finished.wait(30) and not holder.completed
    assert not console_errors(driver)


def test_stop_ends_the_request_and_regenerate_asks_again(server: Server, driver: Any) -> None:
    new_chat(driver)
    set_settings(driver, max_tokens="1000", seed="3", json="off")
    send(driver, "Tell me a very long story about a lighthouse keeper.")

    def some_text(d: Any) -> bool:
        md = d.find_elements(By.CSS_SELECTOR, ".msg.assistant .md")
        return bool(md) and len(md[-1].get_attribute("textContent")) > 20

    wait_for(driver, "some of the answer", some_text)
    driver.find_element(By.ID, "stop").click()
    wait_for(driver, "the answer stopped", lambda d: status(d) == "stopped")
    server.wait_cells_free()  # the server aborted it: its cells are back
    stopped = stored_chats(driver)[-1]["messages"][-1]
    assert stopped["meta"]["state"] == "stopped" and stopped["content"]
    set_settings(driver, max_tokens="12")
    driver.find_element(By.XPATH, "//button[contains(., 'Regenerate')]").click()
    record = record_of(wait_answered(driver, 1))
    messages = stored_chats(driver)[-1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]  # the answer replaced
    assert record["usage"]["completion_tokens"] == 12 and messages[-1]["meta"]["state"] == "done"
    assert not console_errors(driver)
