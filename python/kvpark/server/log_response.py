"""One connection reading a kept stream: it writes the stream's log from a cursor on.

The connection that started a reattachable stream reads it from the start, ``GET
/v1/streams/{id}`` after its ``Last-Event-ID``, a background response's POST from the start and
``GET /v1/responses/{id}?stream=true`` after ``starting_after``: the entries already logged, then
the rest as they come. Status and headers go out with the first frame, as on a plain stream, so a
stream that failed before any (a full wait queue's 503) is still a plain JSON error. A connection
that goes away, or stalls past ``--stall-timeout``, only stops reading: the stream goes on without
it, and ``on_close(delivered)`` tells its owner (delivered: the last entry was written).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import Receive, Scope, Send

from kvpark.server.disconnect import unless_disconnected
from kvpark.server.sse import HEADERS
from kvpark.server.stall import StalledClient, send_within
from kvpark.server.stream_log import StreamLog

log = logging.getLogger("kvpark.server")

STREAM_HEADER = "x-kvpark-stream-id"


class LogResponse:
    """ASGI response writing ``stream`` from entry ``cursor`` on."""

    def __init__(
        self,
        stream: StreamLog,
        cursor: int,
        stall_timeout: float,
        on_close: Callable[[bool], None] | None = None,
    ) -> None:
        self.stream = stream
        self.cursor = cursor
        self.stall_timeout = stall_timeout
        self.on_close = on_close
        self.delivered = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(receive, self._write(scope, receive, send))
        finally:
            if self.on_close is not None:
                self.on_close(self.delivered)

    async def _write(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = self.stream
        while not stream.started and not stream.ended:
            await stream.changed()
        if stream.failure is not None and not stream.started:
            await stream.framing.error_response(stream.failure)(scope, receive, send)
            self.delivered = True  # the answer is out: nothing is left to read
            return
        headers = list(HEADERS)
        if stream.stream_id is not None:
            headers.append((STREAM_HEADER.encode(), stream.stream_id.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        pings = stream.pings
        try:
            while True:
                if self.cursor < len(stream.entries):
                    # everything logged so far in one write: a replay is one send, not thousands
                    end = len(stream.entries)
                    await self._body(send, b"".join(stream.entries[self.cursor : end]))
                    self.cursor = end
                    stream.wrote(end)
                    continue
                if stream.ended:
                    break
                if stream.pings != pings:
                    pings = stream.pings
                    await self._body(send, stream.ping)
                    continue
                await stream.changed()
            last = {"type": "http.response.body", "body": b"", "more_body": False}
            await send_within(send, last, self.stall_timeout)
            self.delivered = True
        except OSError:
            return  # the client went away while we wrote: it may come back
        except StalledClient as stalled:
            log.warning("stream %s detached: %s (--stall-timeout)", stream.stream_id, stalled)

    async def _body(self, send: Send, frame: bytes) -> None:
        message = {"type": "http.response.body", "body": frame, "more_body": True}
        await send_within(send, message, self.stall_timeout)
