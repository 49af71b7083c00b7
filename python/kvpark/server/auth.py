"""API-key check: with keys set, every route but ``/health`` (and the web pages) needs one of them.

A key comes as ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (what the
``anthropic`` client sends); either one, if it matches, lets the request in. A pure ASGI
middleware, so a refused request is answered before its body is read, in the shape of the route's
API (Anthropic's on ``/v1/messages``). The comparison is constant-time (``hmac.compare_digest``) so
the answer's timing says nothing about how much of a guess was right; with several keys every one
is compared, so the timing does not say which matched either. The key that let a request in is
left in the request's state (as a digest, :data:`KEY_STATE`) for ``--cache-salt-by-key``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpark.server.errors import APIError
from kvpark.server.messages_api_errors import anthropic_error_response

OPEN_PATHS = frozenset({"/health"})
KEY_STATE = "kvpark.api_key"  # scope["state"][KEY_STATE]: the digest of the key that matched
# routes whose API has its own error shape; the rest answer in OpenAI's
ERROR_SHAPES: dict[str, Callable[[APIError], Response]] = {
    "/v1/messages": anthropic_error_response,
}


class APIKeyMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_keys: Sequence[str],
        also_open: Callable[[str], bool] | None = None,
    ) -> None:
        """``also_open``: paths besides ``/health`` served without a key (the web pages, which
        ask for the key themselves: server/web_pages.py)."""
        self.app = app
        self.keys = [k.encode("utf-8") for k in api_keys]
        self.digests = [hashlib.sha256(k).digest() for k in self.keys]
        self.also_open = also_open

    def _open(self, path: str) -> bool:
        return path in OPEN_PATHS or (self.also_open is not None and self.also_open(path))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._open(scope["path"]):
            await self.app(scope, receive, send)
            return
        bearer = _header(scope, b"authorization")
        api_key = _header(scope, b"x-api-key")
        if bearer is None and api_key is None:
            refusal = APIError(
                401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
        elif (matched := self._match(bearer, api_key)) is not None:
            scope.setdefault("state", {})[KEY_STATE] = self.digests[matched]
            await self.app(scope, receive, send)
            return
        else:
            refusal = APIError(401, "invalid API key")
        response = ERROR_SHAPES.get(scope["path"], APIError.response)(refusal)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _match(self, bearer: bytes | None, api_key: bytes | None) -> int | None:
        """The index of the key given (Bearer first), comparing with every key either way."""
        token = bearer[7:] if bearer is not None and bearer.startswith(b"Bearer ") else None
        found = None
        for given in (token, api_key):
            for i, key in enumerate(self.keys):
                if given is not None and hmac.compare_digest(given, key) and found is None:
                    found = i
        return found


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None
