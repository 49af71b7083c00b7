"""Anthropic-shaped errors for /v1/messages: ``{"type": "error", "error": {"type", "message"}}``.

The route raises the same :class:`APIError` as every other route; only the rendering differs. The
HTTP status is kept (the ``anthropic`` client picks its exception class from it) and the OpenAI
error type becomes Anthropic's by status, so a client that only reads the body still knows what
happened. In a stream the same object goes out as ``event: error``.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from kvpark.server.errors import APIError
from kvpark.server.sse import Framing, typed_frame

# HTTP status -> Anthropic error type (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_type(error: APIError) -> str:
    return ANTHROPIC_TYPES.get(error.status, "api_error")


def anthropic_body(error: APIError) -> dict[str, object]:
    inner: dict[str, object] = {"type": anthropic_type(error), "message": error.message}
    return {"type": "error", "error": inner}


def anthropic_error_response(error: APIError) -> JSONResponse:
    return JSONResponse(anthropic_body(error), status_code=error.status, headers=error.headers())


ANTHROPIC = Framing(
    frame=typed_frame,
    error=lambda error: typed_frame(anthropic_body(error)),
    done=b"",  # the stream ends with message_stop; there is no [DONE]
    error_response=anthropic_error_response,
)
