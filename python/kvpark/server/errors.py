"""OpenAI-shaped JSON errors: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the server gives goes through :class:`APIError`, raised anywhere below a route and
turned into a response by the handler :func:`api_error_response`. ``code`` repeats the HTTP status,
as llama.cpp does, so a client that only reads the body still knows what happened.
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger("kvpark.server")

# HTTP status -> OpenAI error "type" when the raiser does not name one.
DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "unavailable_error",
}
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """A refused request: ``status`` is the HTTP status, ``kind`` the OpenAI error type."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or DEFAULT_TYPES.get(status, "invalid_request_error")
        self.param = param

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_SECONDS)} if self.status == 503 else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


async def api_error_response(request: Request, exc: Exception) -> Response:
    """Exception handler for :class:`APIError`."""
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error_response(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown route 404, wrong method 405) in the OpenAI shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"unknown route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message).response()


async def internal_error_response(request: Request, exc: Exception) -> Response:
    """A genuine bug: log it with its traceback, answer 500, keep serving."""
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}").response()
