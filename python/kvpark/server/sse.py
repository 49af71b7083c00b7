"""Server-sent events: OpenAI chunks as ``data:`` lines, park notices and pings as comments.

A stream is, in order::

    [: queued N ...]  [: preempted]  [: resumed]  data: {chunk}  ...  :  ...  data: {last chunk}
    data: [DONE]

Notices (``: preempted``, ``: resumed``, ``: recomputed``) are SSE comments, invisible to clients
that ignore comments; in a request of several prompts each names its prompt as its last word
(``: preempted 1``). Pings are comments too: ``:`` after ``ping_interval`` s without a frame, or
``: preempt-keepalive`` every ``min(ping_interval, 2 s)`` while any prompt of the request is
parked. ``ping_interval <= 0`` turns the plain ping off but keeps the keepalive (every 2 s).

A request that waits in the engine's queue (for a slot or for room) opens its stream with
``: queued N`` (N: its 1-based place in the wait queue) as soon as the engine finds it waiting, and
repeats it with its current place every ``ping_interval`` (every 2 s when pings are off) until its
first token or park notice, so no client waits in silence. In a request of several prompts each
names its prompt last, as notices do: ``: queued 3 1`` is prompt 1 at place 3. No plain ping opens
a stream: a request that is not queued sends its first bytes with its first token, park notice (a
request parked before its first token opens its stream with the notice: docs/server.md,
"Streams") or error.

Status and headers go out with the first frame, so a request the engine refuses or fails before
anything is sent (a full wait queue: 503) still gets a plain JSON error with its own status; once a
frame is out, an error travels in-stream as ``data: {"error": ...}`` followed by ``data: [DONE]``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvpark.engine.outputs import ErrorEvent, FinishedEvent, NoticeEvent, QueuedEvent, TokenEvent
from kvpark.server.disconnect import unless_disconnected
from kvpark.server.errors import APIError
from kvpark.server.fanout import End, PromptEvent, Timeout
from kvpark.server.responses import JSON
from kvpark.server.stall import StalledClient, send_within

log = logging.getLogger("kvpark.server")

PING = b":\n\n"
KEEPALIVE = b": preempt-keepalive\n\n"
DONE = b"data: [DONE]\n\n"
KEEPALIVE_CAP_S = 2.0
REQUEST_ID_HEADER = b"x-kvpark-request-id"  # the id /slots and the pool view name it by
HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class EventSource(Protocol):
    async def next(self, timeout: float | None) -> PromptEvent | Timeout | End: ...


QueuePosition = Callable[[int], "int | None"]
"""A prompt's current place in the engine's wait queue, or None once it has left the queue."""


class StreamBuilder(Protocol):
    """What a stream's frames are built from: the OpenAI ``ResponseBuilder`` or another API's."""

    def on_tokens(self, prompt: int, event: TokenEvent) -> list[JSON]: ...

    def on_finished(self, event: FinishedEvent) -> None: ...

    def closing_chunks(self) -> list[JSON]: ...


def data_frame(obj: Mapping[str, object]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def typed_frame(obj: Mapping[str, object]) -> bytes:
    """``event: <type>`` then the data line: how the Responses and Anthropic APIs frame events."""
    return f"event: {obj['type']}\n".encode() + data_frame(obj)


@dataclass(frozen=True)
class Framing:
    """How one API writes its events: a chunk's frame, the in-stream error, the closing sentinel.

    The default is OpenAI's chat and completions: ``data:`` lines, the error object as a chunk,
    ``data: [DONE]``. Comments (notices, pings, ``: queued``) are the same for every API."""

    frame: Callable[[Mapping[str, object]], bytes] = data_frame
    error: Callable[[APIError], bytes] = lambda error: data_frame(error.body())
    done: bytes = DONE
    # a failure before the first frame: a plain JSON error in the API's own shape
    error_response: Callable[[APIError], Response] = lambda error: error.response()


OPENAI = Framing()


def notice_frame(kind: str, prompt: int | None) -> bytes:
    return f": {kind}\n\n".encode() if prompt is None else f": {kind} {prompt}\n\n".encode()


def queued_frame(position: int, prompt: int | None) -> bytes:
    return notice_frame(f"queued {position}", prompt)


class Pacer:
    """When the next ping is due and what it says; ``parked`` holds the prompts now parked and
    ``queued`` the places of the prompts still waiting in the engine's queue."""

    def __init__(
        self,
        ping_interval: float,
        keepalive_cap: float = KEEPALIVE_CAP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ping_interval = ping_interval
        self.keepalive = min(ping_interval, keepalive_cap) if ping_interval > 0 else keepalive_cap
        # a queued client hears about its place even with pings off: waiting is never silent
        self.queue_period = ping_interval if ping_interval > 0 else keepalive_cap
        self.clock = clock
        self.parked: set[int] = set()
        self.queued: dict[int, int] = {}
        self.last_frame = clock()

    def wrote(self) -> None:
        self.last_frame = self.clock()

    def notice(self, kind: str, prompt: int) -> None:
        if kind == "preempted":
            self.parked.add(prompt)
        elif kind == "resumed":
            self.parked.discard(prompt)

    def event(self, prompt: int) -> None:
        """Any event but ``QueuedEvent``: the prompt has left the queue (a token, a notice, the
        end), so its ``: queued`` comments stop."""
        self.queued.pop(prompt, None)

    def timeout(self) -> float | None:
        """Seconds until the next ping is due, or None if no ping is ever due."""
        periods = [self.keepalive] if self.parked else []
        if self.queued:
            periods.append(self.queue_period)
        period = min(periods) if periods else self.ping_interval
        if period <= 0:
            return None
        return max(0.0, self.last_frame + period - self.clock())

    def ping(self) -> bytes:
        return KEEPALIVE if self.parked else PING

    def pings(self, position: QueuePosition | None, multi_prompt: bool) -> list[bytes]:
        """What a due ping says: each queued prompt's current place, and the park keepalive or the
        plain ping. A prompt that ``position`` finds out of the queue is no longer reported."""
        if position is not None:
            for prompt in list(self.queued):
                place = position(prompt)
                if place is None:
                    del self.queued[prompt]  # admitted: its first token is on its way
                else:
                    self.queued[prompt] = place
        frames = [
            queued_frame(place, prompt if multi_prompt else None)
            for prompt, place in sorted(self.queued.items())
        ]
        if self.parked or not frames:
            frames.append(self.ping())
        return frames


async def sse_frames(
    events: EventSource,
    builder: StreamBuilder,
    ping_interval: float,
    multi_prompt: bool,
    keepalive_cap: float = KEEPALIVE_CAP_S,
    position: QueuePosition | None = None,
    framing: Framing = OPENAI,
) -> AsyncGenerator[bytes, None]:
    """Frames of one stream; raises :class:`APIError` if it fails before its first frame.

    ``position`` reads a queued prompt's current place for the repeated ``: queued`` comments;
    without it they repeat the place the engine first reported. ``framing`` is the API's way of
    writing chunks, errors and the end.
    """
    pacer = Pacer(ping_interval, keepalive_cap)
    started = False
    while True:
        item = await events.next(pacer.timeout() if started else None)
        frames: list[bytes] = []
        if item == "end":
            break
        if item != "timeout" and not isinstance(item.event, QueuedEvent):
            pacer.event(item.prompt)  # a token, notice or end: that prompt has left the queue
        if item == "timeout":
            frames.extend(pacer.pings(position, multi_prompt))
        elif isinstance(item.event, QueuedEvent):
            pacer.queued[item.prompt] = item.event.position
            frames.append(queued_frame(item.event.position, item.prompt if multi_prompt else None))
        elif isinstance(item.event, TokenEvent):
            frames.extend(framing.frame(c) for c in builder.on_tokens(item.prompt, item.event))
        elif isinstance(item.event, NoticeEvent):
            pacer.notice(item.event.kind, item.prompt)
            frames.append(notice_frame(item.event.kind, item.prompt if multi_prompt else None))
        elif isinstance(item.event, FinishedEvent):
            builder.on_finished(item.event)
        elif isinstance(item.event, ErrorEvent):
            error = APIError(item.event.code, item.event.message, item.event.kind)
            if not started:
                raise error
            yield framing.error(error)
            if framing.done:
                yield framing.done
            return
        for frame in frames:
            started = True
            yield frame
        if frames:
            pacer.wrote()
    for chunk in builder.closing_chunks():
        yield framing.frame(chunk)
    if framing.done:
        yield framing.done


class SSEResponse:
    """ASGI response for a frame generator: headers with the first frame, abort on disconnect."""

    def __init__(
        self,
        frames: AsyncGenerator[bytes, None],
        framing: Framing = OPENAI,
        stall_timeout: float = 0.0,
        request_id: str = "",
    ) -> None:
        self.frames = frames
        self.framing = framing
        self.stall_timeout = stall_timeout  # a write waiting longer ends the stream (stall.py)
        self.request_id = request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(receive, self._write(scope, receive, send))
        finally:
            await self.frames.aclose()

    async def _write(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await self.frames.__anext__()
        except StopAsyncIteration:
            first = b""
        except APIError as error:
            await self.framing.error_response(error)(scope, receive, send)
            return
        except Exception as exc:
            log.error("stream failed before its first frame", exc_info=exc)
            failure = APIError(500, f"internal error: {type(exc).__name__}")
            await self.framing.error_response(failure)(scope, receive, send)
            return
        headers = list(HEADERS)
        if self.request_id:  # before any chunk carries the id: a page that looks up /slots
            headers.append((REQUEST_ID_HEADER, self.request_id.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            await self._body(send, first)
            try:
                async for frame in self.frames:
                    await self._body(send, frame)
            except (OSError, StalledClient):
                raise
            except Exception as exc:  # a bug below us: tell the client in-stream, keep serving
                log.error("stream failed", exc_info=exc)
                failure = APIError(500, f"internal error: {type(exc).__name__}")
                await self._body(send, self.framing.error(failure) + self.framing.done)
            last = {"type": "http.response.body", "body": b"", "more_body": False}
            await send_within(send, last, self.stall_timeout)
        except OSError:
            return  # the client went away while we wrote; the frames close in __call__
        except StalledClient as stalled:
            # Returning closes the frames (and so aborts the engine requests) in __call__;
            # uvicorn then closes the connection it could not finish.
            log.warning("stream %s aborted: %s (--stall-timeout)", self.request_id, stalled)

    async def _body(self, send: Send, frame: bytes) -> None:
        message = {"type": "http.response.body", "body": frame, "more_body": True}
        await send_within(send, message, self.stall_timeout)
