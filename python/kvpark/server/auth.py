"""API-key check: with a key set, every route but ``/health`` needs ``Authorization: Bearer KEY``.

A pure ASGI middleware, so a refused request is answered before its body is read. The comparison is
constant-time (``hmac.compare_digest``) so the answer's timing says nothing about how much of a
guess was right.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvpark.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization")
        if given is None:
            refusal = APIError(401, "missing API key: send 'Authorization: Bearer <key>'")
        elif not hmac.compare_digest(given, self.expected):
            refusal = APIError(401, "invalid API key")
        else:
            await self.app(scope, receive, send)
            return
        response = refusal.response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None
