"""``--stream-buffer``: a stream's ``FanIn`` holds at most that many events its reader has not
taken (server/fanout.py); one more cancels every prompt's generator, which is what aborts their
engine requests, and the reader, should it read again, gets what was held and then a 503 error.
A reader that keeps up is never cut off, however long the stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvpark.engine.outputs import ErrorEvent, FinishedEvent, StreamEvent, TokenEvent
from kvpark.sampling.params import SamplingParams
from kvpark.server.fanout import FanIn, PromptEvent

LIMIT = 8


class Endless:
    """An engine stand-in: a token per tick for ever; records whether its stream was closed."""

    def __init__(self, tokens: int = 10**9) -> None:
        self.closed = 0
        self.tokens = tokens

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[StreamEvent]:
        try:
            for i in range(self.tokens):
                await asyncio.sleep(0)
                yield TokenEvent(0, "x", [i], None)
            yield FinishedEvent(1, self.tokens, 0.0, 0.0)
        finally:
            self.closed += 1  # AsyncEngine.generate aborts its engine request here


def events_of(prompts: int, engine: Endless) -> FanIn:
    params = [SamplingParams(max_tokens=10)] * prompts
    return FanIn(engine.generate, [[1]] * prompts, params, "cmpl-test", buffer_limit=LIMIT)


async def read_all(fan_in: FanIn) -> list[StreamEvent]:
    got: list[StreamEvent] = []
    while (item := await fan_in.next(5.0)) != "end":
        assert isinstance(item, PromptEvent)
        got.append(item.event)
    return got


def test_a_reader_that_stops_gets_the_held_events_then_an_error() -> None:
    async def run() -> tuple[list[StreamEvent], int]:
        engine = Endless()
        async with events_of(2, engine) as fan_in:
            for _ in range(50):  # the reader takes nothing while the engine makes tokens
                await asyncio.sleep(0)
            assert engine.closed == 2  # both prompts' generators closed: aborted, not waiting
            return await read_all(fan_in), engine.closed

    got, closed = asyncio.run(run())
    assert closed == 2
    assert len(got) == LIMIT + 1
    assert all(isinstance(e, TokenEvent) for e in got[:LIMIT])
    error = got[-1]
    assert isinstance(error, ErrorEvent) and error.code == 503
    assert f"did not read {LIMIT} events" in error.message


def test_a_reader_that_keeps_up_reads_past_the_bound() -> None:
    async def run() -> list[StreamEvent]:
        engine = Endless(tokens=LIMIT * 20)
        async with events_of(1, engine) as fan_in:
            return await read_all(fan_in)

    got = asyncio.run(run())
    assert len(got) == LIMIT * 20 + 1 and isinstance(got[-1], FinishedEvent)
