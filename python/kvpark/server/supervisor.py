"""What ``kvpark serve`` does about a signal or a failed engine, so a supervisor (systemd,
Kubernetes) sees what happened: a drain that exits 0, or a failure that exits 1.

SIGTERM or SIGINT: ``/health`` turns 503 ``draining`` and new requests get 503 with
``Retry-After`` (server/lifecycle.py), while the running ones have ``--shutdown-timeout`` seconds
to finish; those still running then end with their last events (an in-stream error, each open
choice's ``finish_reason: "error"`` on the OpenAI routes: server/relay.py; a plain request a 503),
and uvicorn closes down. A second signal ends them at once, the same way. The exit status is 0.

uvicorn's own handling would wait a fixed time, cut streams with no last event, log the
cancellations' tracebacks and raise the signal again on the way out (status 143), so
:class:`SupervisedServer` takes the two signals for itself.

The engine fails (its thread died, or raised where nothing could be failed alone; or it spent more
than ``--engine-timeout`` seconds in one turn of its loop, a wedged step): every open request ends
with an error event, ``/health`` answers 503 with the reason and new requests 503, for
:data:`FAILED_LINGER_S` (so a load balancer's probe and the clients can see why), then the process
exits with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Generator
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from kvpark.config.layers import ServerConfig
from kvpark.server.lifecycle import SHUTTING_DOWN, Lifecycle

if TYPE_CHECKING:
    from kvpark.engine.async_engine import AsyncEngine

log = logging.getLogger("kvpark.server")
POLL_S = 0.05
FAILED_LINGER_S = 2.0  # a failed server answers 503s this long before it exits
LAST_EVENTS_S = 5.0  # how long ended requests may take to write their last events
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SupervisedServer(uvicorn.Server):
    """uvicorn, with SIGTERM and SIGINT handed to :class:`Lifecycle` instead of its own exit."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only: whoever runs us there handles them
            return
        loop = asyncio.get_running_loop()

        def handler(sig: int, frame: FrameType | None) -> None:
            loop.call_soon_threadsafe(self.lifecycle.on_signal, sig)

        # signal.signal, as uvicorn does, so that the previous handlers come back afterwards
        original = {sig: signal.signal(sig, handler) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, previous in original.items():
                signal.signal(sig, previous)


async def supervise(
    server: uvicorn.Server, engine: AsyncEngine, lifecycle: Lifecycle, config: ServerConfig
) -> None:
    """Until the server exits: watch the engine's health and the signals, and act on them."""
    while not server.should_exit:
        if _failure(engine, config) is not None:
            await _fail(server, engine, lifecycle, config)
            return
        if lifecycle.draining:
            await _drain(server, engine, lifecycle, config)
            return
        await asyncio.sleep(POLL_S)


def _failure(engine: AsyncEngine, config: ServerConfig) -> str | None:
    return engine.health(config.engine_timeout) if engine.ready else None


async def _fail(
    server: uvicorn.Server, engine: AsyncEngine, lifecycle: Lifecycle, config: ServerConfig
) -> None:
    reason = _failure(engine, config)
    assert reason is not None
    engine.fail(reason)  # a no-op if the engine thread did it itself
    log.error("the engine failed (%s): answering 503, exiting with status 1", reason)
    await asyncio.sleep(FAILED_LINGER_S)
    await _until_answered(lifecycle, LAST_EVENTS_S)
    server.should_exit = True


async def _drain(
    server: uvicorn.Server, engine: AsyncEngine, lifecycle: Lifecycle, config: ServerConfig
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.shutdown_timeout
    if lifecycle.in_flight:
        log.info(
            "waiting up to %g s (--shutdown-timeout) for %d running request(s)",
            config.shutdown_timeout,
            lifecycle.in_flight,
        )
    while lifecycle.in_flight and not lifecycle.forced and loop.time() < deadline:
        if _failure(engine, config) is not None:
            await _fail(server, engine, lifecycle, config)
            return
        await asyncio.sleep(POLL_S)
    if lifecycle.in_flight:
        why = "a second signal" if lifecycle.forced else "--shutdown-timeout"
        ended = engine.end_streams(f"{SHUTTING_DOWN}: the request was ended by {why}")
        log.warning("%s: ending %d running request(s)", why, len(ended))
        await _until_answered(lifecycle, LAST_EVENTS_S)
    log.info("drained: shutting down")
    server.should_exit = True


async def _until_answered(lifecycle: Lifecycle, timeout: float) -> None:
    """Until no request is in flight (their last events are out), at most ``timeout`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while lifecycle.in_flight and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
