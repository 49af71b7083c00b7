"""Nobody waits in silence (issue 10), the SSE framing: with a scripted event source, a queued
stream opens with ``: queued N`` and repeats its current place, each queued prompt of a request is
named, a prompt that left the queue stops hearing it, and queued comments go on when pings are off.
test_server_queued.py has the real server, test_engine_queue_limit.py the engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvpark.engine.outputs import NoticeEvent, QueuedEvent, StreamEvent
from kvpark.server.sse import KEEPALIVE, PING, Pacer, sse_frames
from support.scripted import FINISHED, ScriptedSource, builder, token


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
