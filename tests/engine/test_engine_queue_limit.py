"""Nobody waits in silence (issue 10), the engine: the ``--max-waiting`` check is made when a
request is added, on the engine thread, and a full queue is a 503 as the request's first event;
the prompts of one request are refused together and leave nothing behind; offline generation
still runs. A fake runner decodes token 0 at a fixed pace. test_server_queued.py has the real
server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kvpark
from kvpark.config.layers import EngineConfig
from kvpark.engine.async_engine import AsyncEngine
from kvpark.engine.llm_engine import LLMEngine, RequestRejected
from kvpark.engine.outputs import ErrorEvent, FinishedEvent, QueuedEvent, StreamEvent
from kvpark.sampling.params import SamplingParams
from kvpark.sched.plan import StepPlan
from kvpark.server.fanout import FanIn


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
