"""What the web pages' tests do in the browser: open a page (entering the API key where the page
asks for it), set a conversation's settings, send a message and wait for its answer, read what the
page shows and stores, and watch the status line of an answer as it changes."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from support.browser import wait_for
from support.servers import Server

STORE = "kvpark.chats.v1"
# every label an answer's status line takes while the page is watched (text nodes are replaced,
# never edited, so each label is a node of its own, however quickly the next one follows)
WATCH_LABELS = """
window.kvparkLabels = [];
new MutationObserver((records) => {
  for (const record of records) {
    for (const node of record.addedNodes) {
      if (node.nodeType === 3 && node.parentElement?.classList.contains("label")) {
        window.kvparkLabels.push(node.data);
      }
    }
  }
}).observe(document.getElementById("messages"), {subtree: true, childList: true});
"""


def open_page(driver: Any, url: str, key: str | None = None) -> None:
    """Load a page; where it asks for the API key, give ``key``. Returns once the page has what
    it needs to work: the model's name (chat) or a first drawing (pool)."""
    driver.get(url)
    pool = url.rstrip("/").endswith("/pool")

    def settled(d: Any) -> str | bool:
        if d.execute_script("return document.getElementById('key-dialog').open"):
            return "asks"
        if pool:
            return bool(d.find_element(By.ID, "grid").get_attribute("data-draws"))
        return bool(d.find_element(By.ID, "model").text)

    if wait_for(driver, f"{url} ready or asking for the key", settled) == "asks":
        assert key is not None, f"{url} asked for an API key"
        dialog = driver.find_element(By.ID, "key-dialog")
        dialog.find_element(By.ID, "key-input").send_keys(key)
        dialog.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait_for(driver, f"{url} ready after the key", lambda d: settled(d) is True)
    assert key is None or key not in driver.current_url


def set_settings(driver: Any, **values: str) -> None:
    """Open the settings panel, set each field (``max_tokens="40"``, ``json="on"``), close it
    again."""
    driver.find_element(By.ID, "settings-button").click()
    for name, value in values.items():
        field = driver.find_element(By.ID, f"set-{name}")
        if field.get_attribute("type") == "checkbox":  # "on" or "off"
            if field.is_selected() != (value == "on"):
                field.click()
        elif field.get_attribute("type") == "range":  # a slider: set it as a drag would
            driver.execute_script(
                "arguments[0].value = arguments[1];"
                "arguments[0].dispatchEvent(new Event('input', {bubbles: true}));",
                field,
                value,
            )
        else:
            field.clear()
            field.send_keys(value)
    driver.find_element(By.ID, "settings-close").click()


def send(driver: Any, text: str) -> None:
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def wait_answered(driver: Any, answers: int, timeout: float = 120.0) -> Any:
    """The ``answers``-th answer of the conversation in view, once it has its last numbers."""

    def done(d: Any) -> Any:
        found = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        if len(found) < answers:
            return None
        last = found[answers - 1]
        return last if last.find_elements(By.CSS_SELECTOR, ".stats .stat.tokens") else None

    return wait_for(driver, f"answer {answers} finished", done, timeout)


def stored_chats(driver: Any) -> list[dict[str, Any]]:
    """The conversations as the page keeps them in localStorage."""
    saved = driver.execute_script(f"return localStorage.getItem('{STORE}')")
    assert saved, "the page stored no conversation"
    chats: list[dict[str, Any]] = json.loads(saved)["chats"]
    return chats


def record_of(answer: Any) -> dict[str, Any]:
    """The server's numbers for an answer, as its "details" show them."""
    raw = answer.find_element(By.CSS_SELECTOR, ".raw pre").get_attribute("textContent")
    record: dict[str, Any] = json.loads(raw)
    return record


def screenshot(driver: Any, name: str) -> None:
    """Where ``WEB_SCREENSHOTS`` names a folder (docs/images for docs/web.md), the page as it
    is now, as ``name``."""
    folder = os.environ.get("WEB_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(Path(folder) / name))


class ChatThread:
    """A streamed chat from Python, beside the browser's: ``stop()`` hangs up (the server aborts
    it); ``finished`` is set when it ends, ``completed`` when it was read to ``[DONE]``."""

    def __init__(self, server: Server, text: str, max_tokens: int) -> None:
        self.body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        self.server = server
        self.started = threading.Event()  # its first chunk came: it holds a slot
        self.finished = threading.Event()
        self.completed = False
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            with (
                self.server.client() as client,
                client.stream("POST", "/v1/chat/completions", json=self.body) as response,
            ):
                assert response.status_code == 200, response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.started.set()
                    if line == "data: [DONE]":
                        self.completed = True
                    if self._stop.is_set():
                        return
        finally:
            self.finished.set()

    def stop(self) -> None:
        self._stop.set()


def chat_in_thread(server: Server, text: str, max_tokens: int) -> ChatThread:
    return ChatThread(server, text, max_tokens)
