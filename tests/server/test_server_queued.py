"""Nobody waits in silence (issue 10): queued streams hear their place; a full queue is a plain 503.

Three levels: the SSE framing of ``: queued N`` with a scripted event source; the engine, where the
``--max-waiting`` check is made when a request is added, on the engine thread (a fake runner that
decodes token 0 at a fixed pace); and a real server with one slot, where one long stream holds the
slot while others queue behind it or are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch

import kvpark
from kvpark.config.layers import EngineConfig
from kvpark.engine.async_engine import AsyncEngine
from kvpark.engine.llm_engine import LLMEngine, RequestRejected
from kvpark.engine.outputs import ErrorEvent, FinishedEvent, NoticeEvent, QueuedEvent, StreamEvent
from kvpark.sampling.params import SamplingParams
from kvpark.sched.plan import StepPlan
from kvpark.server.fanout import FanIn
from kvpark.server.sse import KEEPALIVE, PING, Pacer, sse_frames
from support.scripted import FINISHED, ScriptedSource, builder, token
from support.servers import Server, serve_for_module
from support.sse import sse_data

# -- framing ---------------------------------------------------------------------------------------


async def frames_of(
    script: list[tuple[float, int, StreamEvent]], ping: float, n_prompts: int = 1, **kw: Any
) -> list[bytes]:
    frames = sse_frames(ScriptedSource(script), builder(n_prompts), ping, n_prompts > 1, **kw)
    return [frame async for frame in frames]


def test_a_queued_stream_opens_with_its_place_and_repeats_the_current_one() -> None:
    script: list[tuple[float, int, StreamEvent]] = [
        (0.0, 0, QueuedEvent(2)),
        (0.5, 0, token("x")),
        (0.9, 0, token("y", "stop")),
        (0.9, 0, FINISHED),
    ]
    frames = asyncio.run(frames_of(script, 0.1, position=lambda prompt: 1))
    first_data = next(i for i, f in enumerate(frames) if f.startswith(b"data: "))
    assert frames[0] == b": queued 2\n\n"  # the stream opens with it: status and headers go out
    assert len(frames[1:first_data]) >= 3 and set(frames[1:first_data]) == {b": queued 1\n\n"}
    after = frames[first_data:]
    assert PING in after and not any(f.startswith(b": queued") for f in after)


def test_each_queued_prompt_is_named_last_and_a_prompt_that_left_stops() -> None:
    places = {0: 1, 1: 2}
    script: list[tuple[float, int, StreamEvent]] = [
        (0.0, 0, QueuedEvent(1)),
        (0.0, 1, QueuedEvent(2)),
        (0.35, 0, NoticeEvent("preempted")),  # prompt 0 got going (and was parked at once)
        (0.7, 0, NoticeEvent("resumed")),
        (0.7, 0, token("a", "stop")),
        (0.7, 0, FINISHED),
        (0.7, 1, token("b", "stop")),
        (0.7, 1, FINISHED),
    ]
    frames = asyncio.run(frames_of(script, 0.1, 2, position=places.get, keepalive_cap=0.1))
    assert frames[:2] == [b": queued 1 0\n\n", b": queued 2 1\n\n"]
    parked = frames[frames.index(b": preempted 0\n\n") + 1 : frames.index(b": resumed 0\n\n")]
    # while prompt 0 is parked, prompt 1 still hears its place, beside the park keepalive
    assert b": queued 2 1\n\n" in parked and KEEPALIVE in parked
    assert b": queued 1 0\n\n" not in parked and PING not in parked


def test_queued_comments_go_on_when_pings_are_off() -> None:
    now = [0.0]
    pacer = Pacer(0.0, clock=lambda: now[0])
    assert pacer.timeout() is None  # pings off: nothing is due ...
    pacer.queued[0] = 4
    assert pacer.timeout() == pytest.approx(2.0)  # ... but a queued client hears its place
    assert pacer.pings(lambda prompt: 3, False) == [b": queued 3\n\n"]
    assert pacer.pings(lambda prompt: None, False) == [PING]  # it left the queue
    assert not pacer.queued and pacer.timeout() is None


# -- the engine ------------------------------------------------------------------------------------


class PacedRunner:
    """A stand-in model: greedy token 0 for every row after ``step_s``, no K/V at all."""

    model_name = "paced"
    row_invariant = True
    max_model_len = 8192

    def __init__(self, tokenizer: kvpark.Tokenizer, step_s: float) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.step_s = step_s

    def execute(self, plan: StepPlan) -> torch.Tensor:
        time.sleep(self.step_s)
        return torch.zeros(sum(item.sample for item in plan.items), self.vocab_size)

    def bytes_per_cell(self) -> int:
        return 1

    def host_buffer(self, n_bytes: int) -> torch.Tensor:
        return torch.empty(n_bytes, dtype=torch.uint8)

    def save_cells(self, cells: list[int], out: torch.Tensor) -> None:
        pass

    def restore_cells(self, src: torch.Tensor, cells: list[int]) -> None:
        pass


PROMPT = [1, 2, 3]
LONG = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path: str) -> kvpark.Tokenizer:
    return kvpark.load_tokenizer(default_gguf_path)


def one_slot_config(max_waiting: int) -> EngineConfig:
    options: dict[str, Any] = {"kv_cells": 8192, "parallel": 1, "preempt": False}
    return EngineConfig.from_options(max_waiting=max_waiting, **options)


def test_the_queue_limit_is_checked_as_a_request_is_added(tokenizer: kvpark.Tokenizer) -> None:
    engine = LLMEngine(one_slot_config(max_waiting=1), PacedRunner(tokenizer, 0.0))
    engine.add_request("a", PROMPT, SHORT)  # the free slot will take it: not queued
    engine.add_request("b", PROMPT, SHORT)  # the one place in the queue
    engine.check_request(PROMPT, SHORT)  # validation alone knows nothing of the queue
    with pytest.raises(RequestRejected) as refused:
        engine.add_request("c", PROMPT, SHORT)
    assert (refused.value.code, refused.value.kind) == (503, "unavailable_error")
    engine.step()  # a takes the slot, b still waits beyond it
    with pytest.raises(RequestRejected):
        engine.add_request("c", PROMPT, SHORT)
    assert engine.abort("b")
    engine.add_request("c", PROMPT, SHORT)  # the place is free again
    while engine.has_work:
        engine.step()
    assert engine.scheduler.pool.cells_used() == 0


def test_offline_generation_still_runs(tokenizer: kvpark.Tokenizer) -> None:
    llm = kvpark.LLM(runner=PacedRunner(tokenizer, 0.0), kv_cells=1024, parallel=1, max_waiting=1)
    outs = llm.generate([PROMPT, PROMPT], SHORT)
    assert [o.error for o in outs] == [None, None] and all(len(o.token_ids) == 3 for o in outs)


@pytest.fixture
def async_engine(tokenizer: kvpark.Tokenizer) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(one_slot_config(max_waiting=1), PacedRunner(tokenizer, 0.003))
    engine.start()
    assert engine.wait_ready(60)
    yield engine
    asyncio.run(engine.shutdown())
    assert engine.engine.scheduler.pool.cells_used() == 0


async def wait_until(what: str, condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


def test_a_full_queue_refuses_on_the_engine_thread_as_the_first_event(
    async_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    add = async_engine.engine.add_request

    def recorded(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return add(*args)

    monkeypatch.setattr(async_engine.engine, "add_request", recorded)

    async def main() -> list[StreamEvent]:
        long = async_engine.generate(PROMPT, LONG, "long")
        await long.__anext__()  # its first token: it holds the slot
        waiter = async_engine.generate(PROMPT, SHORT, "waiter")
        refused = async_engine.generate(PROMPT, SHORT, "refused")
        firsts = list(await asyncio.gather(waiter.__anext__(), refused.__anext__()))
        assert async_engine.queue_position("waiter") == 1
        async_engine.check_request(PROMPT, SHORT)  # the loop side does not look at the queue
        await long.aclose()  # hang up: the waiter gets the slot
        rest = [event async for event in waiter]
        await wait_until("no request is left", lambda: not async_engine.engine.has_work)
        return firsts + rest

    events = asyncio.run(main())
    assert events[0] == QueuedEvent(1)
    assert isinstance(events[1], ErrorEvent) and (events[1].code, events[1].kind) == (
        503,
        "unavailable_error",
    )
    assert isinstance(events[-1], FinishedEvent) and events[-1].completion_tokens == 3
    assert threads == ["kvpark-engine"] * 3
    assert async_engine.queue_position("waiter") is None


def test_the_prompts_of_one_request_are_refused_together_and_leave_nothing(
    async_engine: AsyncEngine,
) -> None:
    async def main() -> StreamEvent:
        long = async_engine.generate(PROMPT, LONG, "long")
        await long.__anext__()
        fan_in = FanIn(async_engine.generate, [PROMPT, PROMPT], [SHORT, SHORT], "pair")
        async with fan_in as events:
            first = await events.next(None)  # prompt 1 found no place: before anything else
        queue = async_engine.engine.scheduler.waiting
        await wait_until("prompt 0 is aborted", lambda: not queue)
        await long.aclose()
        await wait_until("no request is left", lambda: not async_engine.engine.has_work)
        assert not isinstance(first, str)
        return first.event

    first = asyncio.run(main())
    assert isinstance(first, ErrorEvent) and first.code == 503


# -- the server ------------------------------------------------------------------------------------

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
