"""A failed step fails only its own requests, on a real ``kvpark serve`` with one slot
(docs/server.md, "Failures and shutdown"): ``KVPARK_FAULT_STEP`` makes one step raise, then
``KVPARK_FAULT_PANIC`` makes a later one raise pyo3's ``PanicException`` (what a Rust panic
raises, a ``BaseException``). Each time the request holding the slot fails (a stream with its
choice's ``finish_reason: "error"`` and the in-stream error, a plain request with a 500), the one
queued behind it runs on and gets the same text as before any fault, the pool's integrity check
runs, and no cell is left held.

Steps are counted only when the model runs, and a request of ``max_tokens`` m run alone takes m of
them, so the faults' step numbers below follow from the requests' lengths.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from support.servers import Server, serve_for_module
from support.sse import sse_data

SHORT = 8  # tokens of the request that waits (and of the reference)
BEFORE_FAULT = 29  # tokens the faulted request streams before its step fails
FAULT_STEP = SHORT + BEFORE_FAULT + 1  # the reference, then the first faulted request
PANIC_STEP = FAULT_STEP + SHORT + BEFORE_FAULT + 1  # the one that waited, then the second
PROMPT = "The capital of France is"
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    faults = {"KVPARK_FAULT_STEP": str(FAULT_STEP), "KVPARK_FAULT_PANIC": str(PANIC_STEP)}
    yield from serve_for_module("--parallel", "1", environ=faults)


def short_body(stream: bool) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": SHORT, "ignore_eos": True, "temperature": 0}
    return {**body, "stream": stream}


class Waiter(threading.Thread):
    """A short stream sent while the slot is taken: its SSE lines, read to the end."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.status = 0
        self.lines: list[str] = []

    def run(self) -> None:
        with self.server.client(TIMEOUT_S) as client:
            body = short_body(stream=True)
            with client.stream("POST", "/v1/completions", json=body) as response:
                self.status = response.status_code
                self.lines = [line for line in response.iter_lines() if line]

    def text(self) -> str:
        self.join(TIMEOUT_S)
        assert self.status == 200 and self.lines[-1] == "data: [DONE]", self.lines
        assert self.lines[0] == ": queued 1", self.lines  # it waited behind the faulted one
        chunks = sse_data(self.lines)
        assert not any("error" in c for c in chunks), chunks
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def wait_decoding(server: Server) -> None:
    """Until the one slot holds a request that is past its first token."""
    deadline = time.monotonic() + TIMEOUT_S
    with server.client() as client:
        while time.monotonic() < deadline:
            slot = client.get("/slots").json()[0]
            if slot["state"] == "decode" and slot["n_decoded"] >= 1:
                return
            time.sleep(0.02)
    raise AssertionError("no request started decoding")


def test_a_failed_step_fails_only_its_requests_and_the_queued_one_runs_on(server: Server) -> None:
    with server.client() as client:
        reference = client.post("/v1/completions", json=short_body(stream=False))
    assert reference.status_code == 200
    expected = reference.json()["choices"][0]["text"]
    assert reference.json()["usage"]["completion_tokens"] == SHORT

    # 1. a step raises: the chat stream in it ends with finish_reason "error", then the error
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
    stream = chat.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=64,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [next(iter(stream))]
    waiter = Waiter(server)
    waiter.start()
    with pytest.raises(openai.APIError) as failed:
        chunks.extend(stream)
    assert failed.value.message == "internal error while running the model"
    assert isinstance(failed.value.body, dict) and failed.value.body["code"] == 500
    # the client's types know no "error": read it as the text it is
    reasons: list[str | None] = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "error" and set(reasons[:-1]) == {None}, reasons
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta]
    assert 1 <= len([t for t in content if t]) <= BEFORE_FAULT
    assert waiter.text() == expected  # it ran on, untouched

    log = server.wait_for_log("after a failed step")
    assert f"a step failed (RuntimeError: KVPARK_FAULT_STEP={FAULT_STEP}" in log
    assert "failing the 1 request(s) in it: chatcmpl-" in log
    assert "the KV pool's integrity check passed after a failed step" in log

    # 2. a later step panics: the plain request in it gets a 500, the queued one runs on
    result: dict[str, httpx.Response] = {}

    def plain() -> None:
        with server.client(TIMEOUT_S) as c:
            body = {**short_body(stream=False), "max_tokens": 64}
            result["plain"] = c.post("/v1/completions", json=body)

    sender = threading.Thread(target=plain, daemon=True)
    sender.start()
    wait_decoding(server)
    waiter = Waiter(server)
    waiter.start()
    sender.join(TIMEOUT_S)
    answer = result["plain"]
    assert answer.status_code == 500, answer.text
    assert answer.json()["error"]["message"] == "internal error while running the model"
    assert waiter.text() == expected

    log = server.log()
    assert f"a step failed (PanicException: KVPARK_FAULT_PANIC={PANIC_STEP}" in log
    assert log.count("the KV pool's integrity check passed after a failed step") == 2
    server.wait_cells_free()
    with server.client() as client:
        assert client.get("/health").json() == {"status": "ok"}
