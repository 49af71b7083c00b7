"""A step that raises after its scheduling released a request, before reporting it: that
request is in no scheduler group any more, so neither the plan nor the running list names it,
and without engine/step_failures.py's ``orphans`` its client would wait forever (the soak's hung
``n=2`` request came from such a release). Driven in-process (``AsyncEngine`` on the example
runner) because only there can a test make the scheduler raise at that exact point.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvpark import SamplingParams
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig, SchedulerConfig
from kvpark.engine.async_engine import AsyncEngine
from kvpark.engine.outputs import ErrorEvent, StreamEvent
from kvpark.runner.echo_runner import EchoRunner
from kvpark.sched.scheduler import Scheduler

PROMPTS = {"A": "one two three one two", "B": "red green blue red", "C": "a b c a b"}


async def collect(stream: AsyncIterator[StreamEvent]) -> list[StreamEvent]:
    return [event async for event in stream]


def test_a_request_released_by_a_failing_step_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = Scheduler.schedule
    calls = {"n": 0}

    def release_c_then_raise(self: Scheduler, *args: object, **kwargs: object) -> object:
        calls["n"] += 1
        waiting = [r for r in self.waiting if r.request_id == "C"]
        if calls["n"] >= 3 and waiting:
            self.release(waiting[0])  # C leaves every group, as a failed overflow leaves it
            raise RuntimeError("scheduling raised after releasing C")
        return schedule(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Scheduler, "schedule", release_c_then_raise)
    config = EngineConfig(
        model=ModelConfig(),
        pool=PoolConfig(kv_cells=256),
        scheduler=SchedulerConfig(parallel=2),  # A and B take both slots: C waits
    )
    engine = AsyncEngine(config, EchoRunner)
    engine.start()
    try:
        assert engine.wait_ready(120), engine.load_error
        encode = engine.tokenizer.encode
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

        async def all_three() -> list[list[StreamEvent]]:
            streams = [engine.generate(encode(p), greedy, k) for k, p in PROMPTS.items()]
            return await asyncio.wait_for(asyncio.gather(*map(collect, streams)), 60)

        results = dict(zip(PROMPTS, asyncio.run(all_three()), strict=True))
        assert calls["n"] >= 3
        c = results["C"]
        assert isinstance(c[-1], ErrorEvent) and c[-1].code == 500, c[-1]
        assert c[-1].message == "internal error while running the model"
        for name in ("A", "B"):  # they held cells when the step raised before its plan
            assert isinstance(results[name][-1], ErrorEvent), results[name][-1]
        scheduler = engine.engine.scheduler
        scheduler.pool.check_integrity()
        assert scheduler.pool.cells_used() == 0
        assert not engine.engine.request_ids
        assert engine.health() is None  # a failed step does not end the engine
    finally:
        asyncio.run(engine.shutdown())
