"""One request's engine events into its API's answer: a stream of frames, or every event fed to
the builder before one object. Every generating route (chat and completions, Responses, Anthropic
Messages) relays through here, so park notices, pings, ``: queued`` places and disconnect aborts
are the same on each. An engine error after an OpenAI stream has started first ends each open
choice with ``finish_reason: "error"`` (server/error_close.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from kvpark.engine.outputs import ErrorEvent, FinishedEvent, TokenEvent
from kvpark.server.error_close import ErrorClose
from kvpark.server.errors import APIError
from kvpark.server.fanout import FanIn
from kvpark.server.sse import OPENAI, EventSource, Framing, StreamBuilder, sse_frames

if TYPE_CHECKING:
    from kvpark.engine.async_engine import AsyncEngine


async def stream_frames(
    engine: AsyncEngine,
    fan_in: FanIn,
    builder: StreamBuilder,
    ping_interval: float,
    multi_prompt: bool,
    framing: Framing = OPENAI,
) -> AsyncGenerator[bytes, None]:
    """The frames of one streamed request (``SSEResponse`` writes them)."""

    def position(prompt: int) -> int | None:  # a queued prompt's current place
        return engine.queue_position(fan_in.engine_request_id(prompt))

    started = False
    async with fan_in as events:
        source: EventSource = events
        if framing is OPENAI:  # each open choice ends with finish_reason "error" on an error
            source = builder = ErrorClose(events, builder, fan_in.choices(), lambda: started)
        frames = sse_frames(
            source, builder, ping_interval, multi_prompt, position=position, framing=framing
        )
        try:
            async for frame in frames:
                started = True
                yield frame
        finally:
            await frames.aclose()


async def collect(fan_in: FanIn, builder: StreamBuilder) -> bool:
    """Every event of every prompt into ``builder``, for a non-streamed answer; True once all are
    in (``unless_disconnected`` answers None instead when the client went away).

    Waiting is not reported here (``QueuedEvent`` and park notices are dropped): the client gets
    one answer at the end whatever happened before it. An engine error is raised as the route's
    ``APIError``."""
    async with fan_in as events:
        while (item := await events.next(None)) != "end":
            assert not isinstance(item, str)
            event = item.event
            if isinstance(event, TokenEvent):
                builder.on_tokens(item.prompt, event)
            elif isinstance(event, FinishedEvent):
                builder.on_finished(event)
            elif isinstance(event, ErrorEvent):
                raise APIError(event.code, event.message, event.kind)
    return True
