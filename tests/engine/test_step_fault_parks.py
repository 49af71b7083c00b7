"""A failed step spares the requests parked and waiting behind it, on the engine thread itself
(engine/engine_thread.py, engine/step_failures.py): the step schedule here is exact, which two
HTTP requests' is not, so this drives ``AsyncEngine`` in-process, on the documented example
runner (kvpark.runner.echo_runner), with the server's own knobs.

Three requests arrive in one tick: A (two choices: never force-parked) and B take the three slots,
C waits. ``KVPARK_PREEMPT_EVERY=3`` parks B once it has 3 tokens, before step 4, and
``KVPARK_FAULT_STEP=4`` makes step 4, which runs A alone, raise. Only A fails; B resumes and C is
admitted, and both end with what they give when nothing fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvpark import SamplingParams
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig, SchedulerConfig
from kvpark.engine.async_engine import AsyncEngine
from kvpark.engine.outputs import ErrorEvent, FinishedEvent, NoticeEvent, StreamEvent, TokenEvent
from kvpark.runner.echo_runner import EchoRunner

PROMPTS = {"A": "one two three one two", "B": "red green blue red", "C": "a b c a b"}
TOKENS = 8


def params(name: str) -> SamplingParams:
    n = 2 if name == "A" else 1
    return SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, n=n)


async def collect(stream: AsyncIterator[StreamEvent]) -> list[StreamEvent]:
    return [event async for event in stream]


def text(events: list[StreamEvent]) -> list[int]:
    assert isinstance(events[-1], FinishedEvent), events[-1]
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def run(fault_step: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[StreamEvent]]:
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", "3")
    monkeypatch.setenv("KVPARK_FAULT_STEP", str(fault_step))
    config = EngineConfig(
        model=ModelConfig(),
        pool=PoolConfig(kv_cells=256),
        scheduler=SchedulerConfig(parallel=3),
    )
    engine = AsyncEngine(config, EchoRunner)
    engine.start()
    try:
        assert engine.wait_ready(120), engine.load_error
        encode = engine.tokenizer.encode

        async def all_three() -> list[list[StreamEvent]]:
            streams = [engine.generate(encode(p), params(k), k) for k, p in PROMPTS.items()]
            return await asyncio.wait_for(asyncio.gather(*map(collect, streams)), 60)

        results = asyncio.run(all_three())
        engine.engine.scheduler.pool.check_integrity()
        assert engine.engine.scheduler.pool.cells_used() == 0
        assert engine.health() is None
        return dict(zip(PROMPTS, results, strict=True))
    finally:
        asyncio.run(engine.shutdown())


def test_a_failed_step_spares_the_parked_and_the_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    clean = run(0, monkeypatch)
    faulted = run(4, monkeypatch)

    a = faulted["A"]
    assert isinstance(a[-1], ErrorEvent) and a[-1].code == 500
    assert a[-1].message == "internal error while running the model"
    tokens = [e for e in a if isinstance(e, TokenEvent)]
    assert len(tokens) == 2 * 3  # its two choices' tokens of steps 1-3, then the failed step

    b = faulted["B"]
    notices = [e.kind for e in b if isinstance(e, NoticeEvent)]
    assert notices[:1] == ["preempted"]  # parked when step 4 failed
    assert text(b) == text(clean["B"])
    assert text(faulted["C"]) == text(clean["C"])
    assert len(text(faulted["C"])) == TOKENS
