"""SSE framing in isolation: notices, pings and keepalives, errors, and the ASGI response.

A scripted event source stands in for the engine, so park notices and long silences happen on cue;
the real server's streams are tested in test_server_stream.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest

from kvpark.engine.outputs import ErrorEvent, NoticeEvent, StreamEvent
from kvpark.sampling.params import SamplingParams
from kvpark.server.disconnect import unless_disconnected
from kvpark.server.errors import APIError
from kvpark.server.fanout import FanIn
from kvpark.server.sse import KEEPALIVE, PING, Pacer, SSEResponse, sse_frames
from support.scripted import FINISHED, ScriptedSource, builder, token


async def collect(
    script: list[tuple[float, int, StreamEvent]],
    ping: float = 30.0,
    cap: float = 2.0,
    n_prompts: int = 1,
    **options: bool,
) -> list[bytes]:
    frames = sse_frames(
        ScriptedSource(script), builder(n_prompts, **options), ping, n_prompts > 1, cap
    )
    return [frame async for frame in frames]


def comments(frames: list[bytes]) -> list[str]:
    return [f.decode().strip() for f in frames if f.startswith(b":")]


def data(frames: list[bytes]) -> list[Any]:
    return [json.loads(f[6:]) for f in frames if f.startswith(b"data: {")]


def test_a_parked_request_opens_its_stream_with_bare_paired_notices() -> None:
    script: list[tuple[float, int, StreamEvent]] = [
        (0, 0, NoticeEvent("preempted")),
        (0, 0, NoticeEvent("resumed")),
        (0, 0, NoticeEvent("recomputed")),
        (0, 0, token("Hi", "stop")),
        (0, 0, FINISHED),
    ]
    frames = asyncio.run(collect(script))
    assert frames[:3] == [b": preempted\n\n", b": resumed\n\n", b": recomputed\n\n"]
    assert frames[-1] == b"data: [DONE]\n\n"
    assert data(frames)[0]["choices"][0]["text"] == "Hi"


def test_every_notice_of_a_multi_prompt_request_names_its_prompt() -> None:
    script: list[tuple[float, int, StreamEvent]] = [
        (0, 1, NoticeEvent("preempted")),
        (0, 0, token("a", "stop")),
        (0, 0, FINISHED),
        (0, 1, NoticeEvent("resumed")),
        (0, 1, token("b", "stop")),
        (0, 1, FINISHED),
    ]
    frames = asyncio.run(collect(script, n_prompts=2))
    assert comments(frames) == [": preempted 1", ": resumed 1"]
    assert sorted(c["choices"][0]["index"] for c in data(frames) if c["choices"]) == [0, 1]


def test_a_parked_stream_gets_keepalives_not_pings() -> None:
    script: list[tuple[float, int, StreamEvent]] = [
        (0.0, 0, NoticeEvent("preempted")),
        (0.5, 0, NoticeEvent("resumed")),
        (0.5, 0, token("x", "stop")),
        (0.5, 0, FINISHED),
    ]
    frames = asyncio.run(collect(script, ping=30.0, cap=0.1))
    between = frames[frames.index(b": preempted\n\n") + 1 : frames.index(b": resumed\n\n")]
    assert len(between) >= 3 and set(between) == {KEEPALIVE}
    assert PING not in frames


def test_an_idle_stream_gets_plain_pings() -> None:
    script: list[tuple[float, int, StreamEvent]] = [
        (0.0, 0, token("x")),
        (0.5, 0, token("y", "stop")),
        (0.5, 0, FINISHED),
    ]
    frames = asyncio.run(collect(script, ping=0.1))
    assert frames.count(PING) >= 3
    assert KEEPALIVE not in frames


def test_no_ping_opens_a_stream() -> None:
    # a request that waits for its first token, and is not queued, sends nothing: its first bytes
    # are a token, a notice or its error (which can then still be a plain JSON answer); a queued
    # one opens with ": queued N" (docs/server.md, "Streams"; test_server_queued.py)
    script: list[tuple[float, int, StreamEvent]] = [
        (0.5, 0, NoticeEvent("preempted")),
        (0.5, 0, NoticeEvent("resumed")),
        (0.5, 0, token("x", "stop")),
        (0.5, 0, FINISHED),
    ]
    frames = asyncio.run(collect(script, ping=0.1))
    assert frames[0] == b": preempted\n\n"


def test_an_error_after_a_long_wait_is_still_plain_json() -> None:
    frames = sse_frames(
        ScriptedSource([(0.4, 0, ErrorEvent("too long", 400))]), builder(), 0.1, False
    )
    sent = [message for _, message in asyncio.run(run_asgi(SSEResponse(frames)))]
    assert sent[0]["status"] == 400


def test_keepalive_period_is_the_smaller_of_ping_and_two_seconds() -> None:
    now = [100.0]
    pacer = Pacer(30.0, clock=lambda: now[0])
    assert pacer.timeout() == 30.0 and pacer.ping() == PING
    pacer.notice("preempted", 0)
    assert pacer.timeout() == 2.0 and pacer.ping() == KEEPALIVE
    now[0] += 1.5
    assert pacer.timeout() == pytest.approx(0.5)
    pacer.notice("resumed", 0)
    assert pacer.ping() == PING
    assert Pacer(0.5).keepalive == 0.5
    off = Pacer(0.0)
    assert off.timeout() is None  # pings off ...
    off.notice("preempted", 0)
    assert off.timeout() == pytest.approx(2.0, abs=0.1)  # ... but a parked one is kept alive


def test_an_error_before_the_first_frame_is_a_plain_error() -> None:
    async def first() -> bytes:
        frames = sse_frames(ScriptedSource([(0, 0, ErrorEvent("full", 503))]), builder(), 30, False)
        return await frames.__anext__()

    with pytest.raises(APIError) as raised:
        asyncio.run(first())
    assert raised.value.status == 503


def test_an_error_after_a_frame_travels_in_stream() -> None:
    frames = asyncio.run(collect([(0, 0, token("a")), (0, 0, ErrorEvent("boom", 500))]))
    assert data(frames)[-1]["error"]["message"] == "boom"
    assert frames[-1] == b"data: [DONE]\n\n"


def test_the_last_chunk_carries_usage_timings_and_preempt() -> None:
    script: list[tuple[float, int, StreamEvent]] = [(0, 0, token("a", "length")), (0, 0, FINISHED)]
    chunks = data(asyncio.run(collect(script, include_usage=True, with_preempt=True)))
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert last["timings"]["prompt_n"] == 3 and last["timings"]["cache_n"] == 0
    assert last["timings"]["predicted_ms"] == 2.0
    assert last["preempt"] == {"parks": 0, "recomputes": 0}


async def run_asgi(response: SSEResponse, disconnect_after: float | None = None) -> list[Any]:
    sent: list[Any] = []
    start = time.monotonic()

    async def receive() -> MutableMapping[str, Any]:
        if disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after or 0.0)
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append((time.monotonic() - start, message))

    await response({"type": "http"}, receive, send)
    return sent


def test_status_and_headers_go_out_with_the_first_frame() -> None:
    script: list[tuple[float, int, StreamEvent]] = [
        (0.3, 0, NoticeEvent("preempted")),
        (0.3, 0, NoticeEvent("resumed")),
        (0.3, 0, token("a", "stop")),
        (0.3, 0, FINISHED),
    ]
    frames = sse_frames(ScriptedSource(script), builder(), 30, False)
    sent = asyncio.run(run_asgi(SSEResponse(frames)))
    at, start = sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert at >= 0.25
    assert sent[1][1]["body"] == b": preempted\n\n"


def test_a_refusal_before_the_first_frame_is_answered_as_json() -> None:
    frames = sse_frames(ScriptedSource([(0, 0, ErrorEvent("bad", 400))]), builder(), 30, False)
    sent = [message for _, message in asyncio.run(run_asgi(SSEResponse(frames)))]
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"]["message"] == "bad"


def test_a_disconnect_closes_the_engine_streams() -> None:
    closed: list[str] = []

    async def endless(
        prompt: list[int], params: SamplingParams, rid: str
    ) -> AsyncIterator[StreamEvent]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield token("x")
        finally:
            closed.append(rid)

    async def main() -> list[Any]:
        fan_in = FanIn(endless, [[1], [2]], [SamplingParams()] * 2, "req")

        async def frames() -> AsyncIterator[bytes]:
            async with fan_in as events:
                async for frame in sse_frames(events, builder(2), 30, True):
                    yield frame

        return await run_asgi(SSEResponse(frames()), disconnect_after=0.2)  # type: ignore[arg-type]

    sent = asyncio.run(main())
    assert sorted(closed) == ["req-0", "req-1"]
    assert sent and not any(m.get("more_body") is False for _, m in sent)


def test_work_that_swallows_a_cancellation_still_ends_when_the_client_leaves() -> None:
    # asyncio.wait_for before Python 3.12 can swallow a cancellation; an endless stream must still
    # stop once its client is gone.
    swallowed: list[bool] = []

    async def stubborn() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.append(True)
        while True:
            await asyncio.sleep(0.01)

    async def receive() -> MutableMapping[str, Any]:
        await asyncio.sleep(0.1)
        return {"type": "http.disconnect"}

    async def main() -> str | None:
        return await asyncio.wait_for(unless_disconnected(receive, stubborn()), 10)

    assert asyncio.run(main()) is None
    assert swallowed == [True]
