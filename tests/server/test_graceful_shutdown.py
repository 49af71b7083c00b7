"""SIGTERM and SIGINT drain a real ``kvpark serve`` (docs/server.md, "Failures and shutdown"):
``/health`` turns 503 ``draining`` and new requests get a 503 with ``Retry-After``, while a running
stream finishes within ``--shutdown-timeout``; past it the running requests end with their last
events (a stream: ``finish_reason: "error"`` and the in-stream error; a plain request: a 503); a
second signal ends them at once. Each time the process exits 0 with no traceback in its log.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion

from support.servers import Server, launch_server, stop_server, wait_healthy

SHUTTING_DOWN = "the server is shutting down"
EXIT_TIMEOUT_S = 30.0
LONG = 3000  # tokens: far more than any of these tests lets run


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    launched = {
        "drains": launch_server(),
        "deadline": launch_server("--shutdown-timeout", "1"),
        "twice": launch_server("--shutdown-timeout", "60"),
    }
    try:
        for server in launched.values():  # all three load at once
            wait_healthy(server)
        yield launched
    finally:
        stop_server(*launched.values())


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)


class Streamed(threading.Thread):
    """A completions stream read to its end: the chunks, and the error that ended it, if any."""

    def __init__(self, server: Server, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.chunks: list[Completion] = []
        self.error: openai.APIError | None = None
        self.first = threading.Event()
        self.start()
        assert self.first.wait(60), "no first chunk"

    def run(self) -> None:
        try:
            for chunk in client(self.server).completions.create(
                model="default",
                prompt="Once upon a time",
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ):
                self.chunks.append(chunk)
                self.first.set()
        except openai.APIError as e:
            self.error = e
        finally:
            self.first.set()

    def finish_reasons(self) -> list[str | None]:
        return [c.choices[0].finish_reason for c in self.chunks if c.choices]

    def ended_by(self, why: str) -> None:
        """It ended with finish_reason "error" and the in-stream error naming ``why``."""
        self.join(EXIT_TIMEOUT_S)
        assert self.error is not None, self.finish_reasons()
        assert self.error.message == f"{SHUTTING_DOWN}: the request was ended by {why}"
        assert isinstance(self.error.body, dict) and self.error.body["code"] == 503
        reasons = self.finish_reasons()
        assert reasons[-1] == "error" and set(reasons[:-1]) == {None}, reasons


def wait_draining(server: Server) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = httpx.get(f"{server.base_url}/health", timeout=5)
        if health.status_code == 503:
            assert health.json() == {"status": "draining"}
            assert health.headers["retry-after"] == "1"
            return
        time.sleep(0.02)
    raise AssertionError("/health never turned 503")


def decoding(server: Server, n: int) -> None:
    """Until ``n`` slots hold requests past their first token."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        slots = httpx.get(f"{server.base_url}/slots", timeout=5).json()
        if sum(s["state"] == "decode" and s["n_decoded"] >= 1 for s in slots) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"fewer than {n} requests decoding")


def exits_cleanly(server: Server) -> float:
    """It exits 0 with no traceback logged; the seconds it took from now."""
    start = time.monotonic()
    try:
        code = server.process.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running:\n{server.log()}") from None
    log = server.log()
    assert code == 0, log
    assert "Traceback" not in log and "CancelledError" not in log, log
    return time.monotonic() - start


def test_sigterm_lets_a_running_stream_finish_and_refuses_new_requests(
    servers: dict[str, Server],
) -> None:
    server = servers["drains"]
    running = Streamed(server, max_tokens=200)
    server.process.send_signal(signal.SIGTERM)
    wait_draining(server)
    refused = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=10,
    )
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["message"] == SHUTTING_DOWN
    anthropic_shape = httpx.post(f"{server.base_url}/v1/messages", json={}, timeout=10)
    assert anthropic_shape.status_code == 503
    assert anthropic_shape.json()["error"]["type"] == "overloaded_error"

    running.join(EXIT_TIMEOUT_S)
    assert running.error is None, running.error
    assert running.finish_reasons()[-1] == "length"
    usage = running.chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 200  # it ran to the end
    exits_cleanly(server)
    assert "SIGTERM: draining" in server.log()


def test_past_the_shutdown_timeout_running_requests_end_with_their_last_events(
    servers: dict[str, Server],
) -> None:
    server = servers["deadline"]
    plain: dict[str, Any] = {}

    def send_plain() -> None:
        try:
            client(server).completions.create(
                model="default", prompt="Hello", max_tokens=LONG, extra_body={"ignore_eos": True}
            )
        except openai.APIStatusError as e:
            plain["error"] = e

    sender = threading.Thread(target=send_plain, daemon=True)
    sender.start()
    running = Streamed(server, max_tokens=LONG)
    decoding(server, 2)  # the plain one too: both run when the signal comes
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    running.ended_by("--shutdown-timeout")
    waited = time.monotonic() - signalled
    assert 1.0 <= waited < 10.0, waited  # not before the timeout, and soon after it
    sender.join(EXIT_TIMEOUT_S)
    error = plain.get("error")
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503, plain
    assert error.response.headers["retry-after"] == "1"
    assert isinstance(error.body, dict)
    assert error.body["message"] == f"{SHUTTING_DOWN}: the request was ended by --shutdown-timeout"
    exits_cleanly(server)


def test_a_second_signal_ends_running_requests_at_once(servers: dict[str, Server]) -> None:
    server = servers["twice"]
    running = Streamed(server, max_tokens=LONG)
    server.process.send_signal(signal.SIGTERM)
    wait_draining(server)
    assert running.is_alive()  # --shutdown-timeout 60: it would have run on
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGINT)
    running.ended_by("a second signal")
    assert time.monotonic() - signalled < 10.0
    assert exits_cleanly(server) < 10.0
    assert "SIGINT again: ending the running requests now" in server.log()
