"""Reattachable streams (``--reattach-seconds N``): a stream outlives its connection by N seconds.

Each such stream runs in a producer task of its own (server/stream_producer.py), not in its
connection: the task takes the stream's frames into its :class:`StreamLog`, and a connection
only writes from the log (server/log_response.py). So a client that goes away costs the stream
nothing: it keeps generating into the log (or stays parked, if the planner parked it for
pressure), and ``GET /v1/streams/{id}`` picks it up after the client's ``Last-Event-ID``.

The rules, all here:

- A stream id is ``strm_`` and 128 random bits. With API keys, only the key that started a stream
  reattaches it; any other gets the 404 an unknown id gets, so ids cannot be probed.
- One connection at a time: a second attach while one is attached is a 409.
- Detached N seconds (its connection gone before its last entry was written), the stream is
  given up: its producer is cancelled, which aborts its engine requests (every cell comes back,
  to the cached pages at most, and every parked byte), and its log is dropped. A stream whose
  last entry a connection wrote is dropped at once.
- Events logged and not yet written to any connection are bounded by ``--stream-buffer``: one
  more ends the stream with the in-stream 503 a plain stream gets (server/fanout.py), which a
  client that comes back still reads.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import AsyncGenerator, Callable

from kvpark.server.errors import APIError
from kvpark.server.lifecycle import Lifecycle
from kvpark.server.sse import Framing
from kvpark.server.stream_log import StreamLog
from kvpark.server.stream_producer import start_producer

log = logging.getLogger("kvpark.server")

ID_PREFIX = "strm_"
ID_BYTES = 16  # 128 random bits


class Reattach:
    def __init__(self, seconds: float, buffer_limit: int, lifecycle: Lifecycle) -> None:
        self.seconds = seconds  # 0: off (every stream belongs to its connection)
        self.buffer_limit = buffer_limit  # events logged and unwritten (0: no bound)
        self.lifecycle = lifecycle
        self._logs: dict[str, StreamLog] = {}
        self._producers: dict[str, asyncio.Task[None]] = {}
        self._timers: dict[str, asyncio.Task[None]] = {}

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    def __len__(self) -> int:
        return len(self._logs)

    def detached(self) -> int:
        """Streams kept without a connection."""
        return sum(not stream.attached for stream in self._logs.values())

    def held_bytes(self) -> int:
        """What every kept log holds (the host memory reattachable streams cost)."""
        return sum(stream.bytes for stream in self._logs.values())

    def start(
        self,
        frames: AsyncGenerator[bytes, None],
        framing: Framing,
        owner: bytes | None,
        give_up: Callable[[str], None],
    ) -> StreamLog:
        """A new stream, its producer running; the caller's connection is attached to it.
        ``give_up(message)`` ends the stream with that in-stream error (its buffer is full)."""
        stream = StreamLog(ID_PREFIX + secrets.token_hex(ID_BYTES), owner, framing)
        stream.attached = True
        self._logs[stream.stream_id or ""] = stream
        bound = self._bound(give_up)
        task = start_producer(stream, frames, self.lifecycle, bound, stream.stream_id or "")
        self._producers[stream.stream_id or ""] = task
        task.add_done_callback(lambda _: self._produced(stream))
        return stream

    def find(self, stream_id: str, key: bytes | None) -> StreamLog:
        """The stream; 404 for an unknown id or another key's (the same answer for both)."""
        stream = self._logs.get(stream_id)
        same_key = stream is not None and (
            stream.owner is None or (key is not None and hmac.compare_digest(stream.owner, key))
        )
        if stream is None or not same_key:
            raise APIError(404, f"no stream {stream_id!r} (unknown, or expired)", param="stream_id")
        return stream

    def attach(self, stream_id: str, key: bytes | None) -> StreamLog:
        """The stream to write from now; 404 for an unknown id or another key's, 409 while one
        connection is attached."""
        stream = self.find(stream_id, key)
        if stream.attached:
            raise APIError(
                409,
                f"stream {stream_id!r} is attached to another connection; retry once it has "
                "closed (a dropped connection is noticed when its socket closes)",
                "conflict_error",
                "stream_id",
            )
        stream.attached = True
        timer = self._timers.pop(stream_id, None)
        if timer is not None:
            timer.cancel()
        return stream

    def detach(self, stream: StreamLog, delivered: bool) -> None:
        """Its connection is done: drop a delivered stream, keep any other ``seconds`` more."""
        stream.attached = False
        stream_id = stream.stream_id or ""
        if stream_id not in self._logs:
            return  # expired or closed meanwhile
        if delivered:
            stream.delivered = True
            self._drop(stream_id)
            return
        self._timers[stream_id] = asyncio.create_task(self._expire(stream))

    async def close(self) -> None:
        """The server is going: every producer cancelled (their engine requests aborted)."""
        tasks = [*self._producers.values(), *self._timers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._logs.clear()

    def _bound(self, give_up: Callable[[str], None]) -> Callable[[StreamLog], None]:
        limit = self.buffer_limit
        over = False

        def check(stream: StreamLog) -> None:
            nonlocal over
            if limit and stream.unread > limit and not over:
                over = True  # once: the error is the last event, whoever reads it
                log.warning(
                    "stream %s aborted: %d events unwritten (--stream-buffer)",
                    stream.stream_id,
                    limit,
                )
                give_up(f"stream buffer full: the client did not read {limit} events")

        return check

    def _produced(self, stream: StreamLog) -> None:
        """The producer is done: nothing more comes. A failure nobody is reading is dropped."""
        stream_id = stream.stream_id or ""
        self._producers.pop(stream_id, None)
        if stream.failure is not None and not stream.attached:
            self._drop(stream_id)

    async def _expire(self, stream: StreamLog) -> None:
        await asyncio.sleep(self.seconds)
        stream_id = stream.stream_id or ""
        # gone for every caller first, so that no attach lands on a stream being cancelled
        self._timers.pop(stream_id, None)
        self._logs.pop(stream_id, None)
        producer = self._producers.pop(stream_id, None)
        running = producer is not None and not producer.done()
        log.info(
            "stream %s expired: unclaimed for %g s (%s)",
            stream_id,
            self.seconds,
            "its requests aborted" if running else "it had ended",
        )
        if producer is not None:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)

    def _drop(self, stream_id: str) -> None:
        self._logs.pop(stream_id, None)
        timer = self._timers.pop(stream_id, None)
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()
        producer = self._producers.pop(stream_id, None)
        if producer is not None and not producer.done():
            producer.cancel()
