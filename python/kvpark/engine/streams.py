"""The open request streams of an ``AsyncEngine``: each request's event loop and queue, and the
one way events reach them from any thread.

The engine thread hands each step's events over with one wake-up of each event loop per step, not
one per request (each wake-up is a write to the loop's self-pipe and a turn of it). When the
engine fails or the server shuts down, :meth:`Streams.end_all` gives every open stream its last
event the same way, from whichever thread decides it.
"""

from __future__ import annotations

import asyncio
import contextlib

from kvpark.engine.outputs import StreamEvent

EventQueue = asyncio.Queue[list[StreamEvent]]
_Stream = tuple[asyncio.AbstractEventLoop, EventQueue]
_Delivery = tuple[EventQueue, list[StreamEvent]]


class Streams:
    def __init__(self) -> None:
        self._open: dict[str, _Stream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def ids(self) -> list[str]:
        return list(self._open)  # a copy: safe while other threads add and remove

    def open(self, request_id: str, loop: asyncio.AbstractEventLoop, queue: EventQueue) -> None:
        self._open[request_id] = (loop, queue)

    def close(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def dispatch(self, events: dict[str, list[StreamEvent]]) -> None:
        """Hand each request's events to its stream (a request whose client is gone: dropped,
        its abort is already queued)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Delivery]] = {}
        for request_id, batch in events.items():
            target = self._open.get(request_id)
            if target is None:
                continue
            loop, q = target
            by_loop.setdefault(loop, []).append((q, batch))
        for loop, deliveries in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that event loop is closed
                loop.call_soon_threadsafe(_deliver, deliveries)

    def end_all(self, event: StreamEvent) -> list[str]:
        """``event`` as the last event of every open stream; the requests it went to."""
        ids = self.ids()
        self.dispatch({request_id: [event] for request_id in ids})
        return ids


def _deliver(deliveries: list[_Delivery]) -> None:
    """On the event loop: each stream's batch into its queue."""
    for q, batch in deliveries:
        q.put_nowait(batch)
