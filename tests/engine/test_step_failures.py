"""A step that raises (engine/async_engine.py ``_main``): the requests in flight end with a 500
error event, even when aborting them raises too, and the engine thread goes on serving the next
request. On the documented example runner (kvpark.runner.echo_runner), made to fail once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvpark import SamplingParams
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.engine.async_engine import AsyncEngine
from kvpark.engine.outputs import ErrorEvent, FinishedEvent, StreamEvent
from kvpark.runner.echo_runner import EchoRunner
from kvpark.sched.plan import StepPlan


class FailsOnce(EchoRunner):
    failures = 1

    def execute(self, plan: StepPlan) -> Any:
        if FailsOnce.failures:
            FailsOnce.failures -= 1
            raise RuntimeError("the model broke")
        return super().execute(plan)


async def run(engine: AsyncEngine, request_id: str) -> list[StreamEvent]:
    ids = engine.engine.tokenizer.encode("one two three one two")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return [e async for e in engine.generate(ids, params, request_id)]


@pytest.mark.parametrize("abort_fails", [False, True])
def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(abort_fails: bool) -> None:
    FailsOnce.failures = 1
    config = EngineConfig(model=ModelConfig(), pool=PoolConfig(kv_cells=256))
    engine = AsyncEngine(config, FailsOnce)
    engine.start()
    try:
        assert engine.wait_ready(60), engine.load_error
        if abort_fails:
            inner = engine.engine

            def broken_abort(request_id: str) -> None:
                raise RuntimeError("its bookkeeping broke too")

            inner.abort = broken_abort  # type: ignore[method-assign]

        async def both() -> tuple[list[StreamEvent], list[StreamEvent]]:
            first = await asyncio.wait_for(run(engine, "first"), 60)
            second = await asyncio.wait_for(run(engine, "second"), 60)
            return first, second

        first, second = asyncio.run(both())
        assert isinstance(first[-1], ErrorEvent) and first[-1].code == 500
        assert isinstance(second[-1], FinishedEvent)
        assert FailsOnce.failures == 0
    finally:
        asyncio.run(engine.shutdown())
