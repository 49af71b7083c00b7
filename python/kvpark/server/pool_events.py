"""``GET /v1/pool/events``: one viewer's connection to the pool hub (server/pool_feed.py).

A snapshot, then deltas as the engine's snapshots come (at most one per ``INTERVAL_S``), and a
``:`` ping after :data:`PING_S` of silence so that a viewer of an idle pool can tell the line is
up. The stream ends when the client goes away (its frames are dropped at once), when one write
waits longer than ``--stall-timeout`` (a client that reads nothing), when the server drains or the
engine fails, and at shutdown. The route is authorised like every API route.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import Receive, Scope, Send

from kvpark.server.disconnect import unless_disconnected
from kvpark.server.lifecycle import Lifecycle
from kvpark.server.pool_feed import PoolHub, Viewer
from kvpark.server.sse import HEADERS, PING
from kvpark.server.stall import StalledClient, send_within

PING_S = 5.0
CHECK_S = 1.0  # how often a quiet stream looks at the drain and the engine's health


class PoolEvents:
    """The ASGI response of one viewer."""

    def __init__(self, hub: PoolHub, lifecycle: Lifecycle, stall_timeout: float) -> None:
        self.hub = hub
        self.lifecycle = lifecycle
        self.stall_timeout = stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        viewer = self.hub.join()
        try:
            await unless_disconnected(receive, self._write(send, viewer))
        finally:
            self.hub.leave(viewer)

    def _open(self) -> bool:
        engine = self.hub.engine
        return not (self.hub.closed or self.lifecycle.draining or engine.failure is not None)

    async def _write(self, send: Send, viewer: Viewer) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        last_write = time.monotonic()
        try:
            while self._open():
                if viewer.frames:
                    await self._body(send, viewer.take())
                    last_write = time.monotonic()
                    continue
                await _wait(viewer.ready, CHECK_S)
                if not viewer.frames and time.monotonic() - last_write >= PING_S:
                    await self._body(send, PING)
                    last_write = time.monotonic()
            last = {"type": "http.response.body", "body": b"", "more_body": False}
            await send_within(send, last, self.stall_timeout)
        except OSError:
            return  # the client went away while we wrote
        except StalledClient:
            return  # it read nothing for --stall-timeout: returning closes the connection

    async def _body(self, send: Send, data: bytes) -> None:
        message = {"type": "http.response.body", "body": data, "more_body": True}
        await send_within(send, message, self.stall_timeout)


async def _wait(event: asyncio.Event, timeout: float) -> None:
    """Until ``event`` is set or ``timeout`` passes. A task and asyncio.wait, not wait_for, which
    before Python 3.12 can swallow the cancellation of a client's disconnect."""
    task = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task}, timeout=timeout)
    finally:
        task.cancel()
