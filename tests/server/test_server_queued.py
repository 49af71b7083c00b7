"""Nobody waits in silence (issue 10), on a real server with one slot: one long stream holds the
slot while others queue behind it, get their headers at once and hear their place, or are refused
with a plain 503 once the queue is full, a request whose prompts do not all fit refused whole.
test_server_queued_frames.py has the SSE framing, test_engine_queue_limit.py the engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from support.servers import Server, serve_for_module
from support.sse import sse_data

MAX_WAITING = 2
LONG_BODY = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
SHORT_BODY = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module(
        *("--parallel", "1", "--max-waiting", str(MAX_WAITING), "--kv-cells", "2048"),
        *("--sse-ping-interval", "0.5"),
    )


def open_stream(client: httpx.Client, body: dict[str, object]) -> httpx.Response:
    """Send and return once the status and headers are in; the body is still to be read."""
    return client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)


@contextlib.contextmanager
def slot_taken(server: Server) -> Iterator[httpx.Response]:
    """A long stream holds the only slot (its first token is out); hung up at exit or on close."""
    with server.client() as client:
        response = open_stream(client, LONG_BODY)
        try:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a dropped line iterator hangs up the stream
            next(line for line in lines if line.startswith("data: "))
            yield response
        finally:
            response.close()


def assert_queue_full(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["type"] == "unavailable_error"


def test_a_queued_stream_gets_its_headers_at_once_and_hears_its_place(server: Server) -> None:
    with slot_taken(server) as holder, server.client() as client:
        waiting = open_stream(client, SHORT_BODY)
        assert waiting.status_code == 200  # while the slot is still held
        assert waiting.headers["content-type"].startswith("text/event-stream")
        lines = (line for line in waiting.iter_lines() if line)
        heard = [(time.monotonic(), next(lines)) for _ in range(3)]
        holder.close()  # the slot comes free
        rest = list(lines)
    assert [line for _, line in heard] == [": queued 1"] * 3
    # one a ping interval (0.5 s), not a flood; httpx may hold a line back until the next chunk
    assert heard[2][0] - heard[0][0] >= 0.4
    first_data = next(i for i, line in enumerate(rest) if line.startswith("data: "))
    assert set(rest[:first_data]) <= {": queued 1", ":"}
    assert rest[-1] == "data: [DONE]"
    assert sse_data(rest)[-1]["choices"][0]["finish_reason"] == "length"
    server.wait_cells_free()


def test_a_multi_prompt_request_hears_each_prompt_and_fills_the_queue(server: Server) -> None:
    pair = {**SHORT_BODY, "prompt": ["Red", "Blue"]}
    with slot_taken(server) as holder, server.client() as client:
        waiting = open_stream(client, pair)
        lines = (line for line in waiting.iter_lines() if line)
        assert {next(lines), next(lines)} == {": queued 1 0", ": queued 2 1"}
        assert_queue_full(client.post("/v1/completions", json={**SHORT_BODY, "stream": False}))
        holder.close()
        rest = list(lines)
    ends = [c["choices"][0] for c in sse_data(rest) if c["choices"]]
    assert sorted(end["index"] for end in ends if end["finish_reason"]) == [0, 1]
    server.wait_cells_free()


def test_a_request_whose_prompts_do_not_all_fit_is_refused_whole(server: Server) -> None:
    with slot_taken(server) as holder, server.client() as client:
        waiting = open_stream(client, SHORT_BODY)  # place 1: one place is left
        lines = (line for line in waiting.iter_lines() if line)
        assert next(lines) == ": queued 1"
        pair = open_stream(client, {**SHORT_BODY, "prompt": ["Red", "Blue"]})
        pair.read()
        assert_queue_full(pair)
        deadline = time.monotonic() + 30
        while server.metric("kvpark_requests_waiting") != 1 and time.monotonic() < deadline:
            time.sleep(0.1)  # prompt 0 was let in, then aborted with its refused sibling
        assert server.metric("kvpark_requests_waiting") == 1
        holder.close()
        assert list(lines)[-1] == "data: [DONE]"
    server.wait_cells_free()


@dataclass
class Attempt:
    """One streaming request on its own thread; it hangs up when ``hang_up`` is set."""

    server: Server
    body: dict[str, object]
    start: threading.Barrier
    hang_up: threading.Event
    answered: threading.Event = field(default_factory=threading.Event)
    status: int = 0
    response: httpx.Response | None = None
    lines: list[str] = field(default_factory=list)

    def run(self) -> None:
        with self.server.client() as client:
            self.start.wait()
            with client.stream("POST", "/v1/completions", json=self.body) as response:
                self.status, self.response = response.status_code, response
                if response.status_code != 200:
                    response.read()
                self.answered.set()
                for line in response.iter_lines() if response.status_code == 200 else ():
                    if line:
                        self.lines.append(line)
                    if self.hang_up.is_set():
                        return


def burst(server: Server, body: dict[str, object], n: int = 12) -> list[Attempt]:
    start, hang_up = threading.Barrier(n), threading.Event()
    attempts = [Attempt(server, body, start, hang_up) for _ in range(n)]
    for attempt in attempts:
        threading.Thread(target=attempt.run, daemon=True).start()
    for attempt in attempts:
        assert attempt.answered.wait(120), "a request was neither let in nor refused"
    return attempts


def check_burst(attempts: list[Attempt], accepted: int) -> list[Attempt]:
    ok = [a for a in attempts if a.status == 200]
    assert len(ok) == accepted, [a.status for a in attempts]
    for refused in (a for a in attempts if a.status != 200):
        assert refused.response is not None
        assert_queue_full(refused.response)
    return ok


def test_a_burst_behind_a_busy_slot_gets_exactly_the_queue(server: Server) -> None:
    with slot_taken(server) as holder:
        attempts = burst(server, SHORT_BODY)
        ok = check_burst(attempts, MAX_WAITING)
        holder.close()
        for attempt in ok:  # let them run to the end
            deadline = time.monotonic() + 120
            while (not attempt.lines or attempt.lines[-1] != "data: [DONE]") and (
                time.monotonic() < deadline
            ):
                time.sleep(0.1)
    for attempt in ok:
        assert attempt.lines[0].startswith(": queued ") and attempt.lines[-1] == "data: [DONE]"
        assert sse_data(attempt.lines)[-1]["choices"][0]["finish_reason"] == "length"
    server.wait_cells_free()
    assert server.metric("kvpark_requests_waiting") == 0


def test_a_burst_at_an_idle_server_lets_in_the_slots_and_the_queue(server: Server) -> None:
    # long streams: none finishes while the burst is admitted, so the count is exact
    attempts = burst(server, LONG_BODY)
    try:
        check_burst(attempts, 1 + MAX_WAITING)  # --parallel 1 + --max-waiting
    finally:
        attempts[0].hang_up.set()  # every one shares the event: all hang up
    server.wait_cells_free()
