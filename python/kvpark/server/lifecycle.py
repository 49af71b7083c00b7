"""Where the server stands once it is up: serving, draining (a SIGTERM or SIGINT came), or done
for (the engine failed), and how many requests are in flight.

The routes read it: while draining or after a failure every route but ``/health`` and
``/metrics`` answers 503 with ``Retry-After`` (in its own API's error shape), and ``/health``
answers 503 with ``{"status": "draining"}`` or ``{"status": "failed", "reason": ...}``.
:class:`InFlight`, an ASGI middleware, counts the requests the drain waits for. What the server
does about a signal or a failure is server/supervisor.py's.
"""

from __future__ import annotations

import logging
import signal

from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("kvpark.server")
POLLED = frozenset({"/health", "/metrics"})  # quick, and a load balancer's: not waited for
SHUTTING_DOWN = "the server is shutting down"


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False  # a first signal came: no new requests, running ones finish
        self.forced = False  # a second one: running requests end now
        self.in_flight = 0  # HTTP requests being answered, the polled paths aside

    def on_signal(self, sig: int) -> None:
        """SIGTERM or SIGINT, on the event loop: the first drains, the next ends at once."""
        name = signal.Signals(sig).name
        if not self.draining:
            log.info("%s: draining (new requests get 503, running ones may finish)", name)
            self.draining = True
        elif not self.forced:
            log.warning("%s again: ending the running requests now", name)
            self.forced = True


class InFlight:
    """Counts the HTTP requests in flight into :attr:`Lifecycle.in_flight`."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in POLLED:
            await self.app(scope, receive, send)
            return
        self.lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.in_flight -= 1
