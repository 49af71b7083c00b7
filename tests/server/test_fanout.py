"""The serving path's hops: one wake-up of the event loop per engine step, and FanIn's reader that
waits on a plain future (no Task per token) without losing an item to a cancelled wait."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvpark.engine.outputs import NoticeEvent, StreamEvent
from kvpark.engine.streams import Streams
from kvpark.sampling.params import SamplingParams
from kvpark.server.fanout import FanIn, PromptEvent


def test_one_step_wakes_each_event_loop_once() -> None:
    streams = Streams()  # the engine thread's hand-over of each step's events
    loop = asyncio.new_event_loop()
    calls = []
    real = loop.call_soon_threadsafe

    def counting(callback, *args):  # type: ignore[no-untyped-def]
        calls.append(callback)
        return real(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign, assignment]
    queues: dict[str, asyncio.Queue[list[StreamEvent]]] = {}
    for rid in ("a", "b", "c"):
        queues[rid] = asyncio.Queue()
        streams.open(rid, loop, queues[rid])
    streams.dispatch({rid: [NoticeEvent(rid)] for rid in ("a", "b", "c", "gone")})
    assert len(calls) == 1  # three streams, one wake-up; the departed request is skipped
    loop.run_until_complete(asyncio.sleep(0))
    assert {rid: q.get_nowait() for rid, q in queues.items()} == {
        rid: [NoticeEvent(rid)] for rid in ("a", "b", "c")
    }
    loop.close()


def test_the_reader_times_out_then_gets_the_item_a_cancelled_wait_left() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()

        async def generate(
            ids: list[int], params: SamplingParams, rid: str
        ) -> AsyncIterator[StreamEvent]:
            await gate.wait()
            yield NoticeEvent("preempted")
            yield NoticeEvent("resumed")

        async with FanIn(generate, [[1]], [SamplingParams()], "r") as events:
            assert await events.next(0.01) == "timeout"
            waiting = asyncio.ensure_future(events.next(None))
            await asyncio.sleep(0)
            waiting.cancel()  # a reader cancelled while it waits (a disconnect, say)
            with pytest.raises(asyncio.CancelledError):
                await waiting
            gate.set()
            await asyncio.sleep(0.01)  # both events arrive while nobody waits
            assert await events.next(1.0) == PromptEvent(0, NoticeEvent("preempted"))
            assert await events.next(1.0) == PromptEvent(0, NoticeEvent("resumed"))
            assert await events.next(1.0) == "end"

    asyncio.run(scenario())
