"""API-key check: with a key set, every route but ``/health`` needs the key.

The key comes as ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (what the
``anthropic`` client sends); either one, if it matches, lets the request in. A pure ASGI
middleware, so a refused request is answered before its body is read, in the shape of the route's
API (Anthropic's on ``/v1/messages``). The comparison is constant-time (``hmac.compare_digest``) so
the answer's timing says nothing about how much of a guess was right.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpark.server.errors import APIError
from kvpark.server.messages_api_errors import anthropic_error_response

OPEN_PATHS = frozenset({"/health"})
# routes whose API has its own error shape; the rest answer in OpenAI's
ERROR_SHAPES: dict[str, Callable[[APIError], Response]] = {
    "/v1/messages": anthropic_error_response,
}


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode("utf-8")
        self.bearer = b"Bearer " + self.key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        bearer = _header(scope, b"authorization")
        api_key = _header(scope, b"x-api-key")
        if bearer is None and api_key is None:
            refusal = APIError(
                401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
        elif self._matches(bearer, self.bearer) or self._matches(api_key, self.key):
            await self.app(scope, receive, send)
            return
        else:
            refusal = APIError(401, "invalid API key")
        response = ERROR_SHAPES.get(scope["path"], APIError.response)(refusal)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    @staticmethod
    def _matches(given: bytes | None, expected: bytes) -> bool:
        return given is not None and hmac.compare_digest(given, expected)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None
