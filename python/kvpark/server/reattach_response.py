"""The connections of a reattachable stream: the POST that starts it, and ``GET
/v1/streams/{stream_id}`` with ``Last-Event-ID`` that picks it up again (server/reattach.py has
the rules, server/log_response.py writes the log).

The POST's own connection reads from the start; a GET from the event after its
``Last-Event-ID`` (absent or ``0``: from the start), so a client that keeps the id of the last
event it read and sends it back gets exactly what it missed, then the rest as it comes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from starlette.requests import Request

from kvpark.server.auth import KEY_STATE
from kvpark.server.errors import APIError
from kvpark.server.log_response import LogResponse
from kvpark.server.reattach import Reattach
from kvpark.server.sse import Framing
from kvpark.server.stream_log import StreamLog


def _reader(registry: Reattach, stream: StreamLog, cursor: int, stall: float) -> LogResponse:
    def on_close(delivered: bool) -> None:
        registry.detach(stream, delivered)

    return LogResponse(stream, cursor, stall, on_close)


def start_reattachable(
    registry: Reattach,
    request: Request,
    frames: AsyncGenerator[bytes, None],
    framing: Framing,
    give_up: Callable[[str], None],
    stall_timeout: float,
) -> LogResponse:
    """A new reattachable stream, read by the request that started it."""
    owner = request.scope.get("state", {}).get(KEY_STATE)
    stream = registry.start(frames, framing, owner, give_up)
    return _reader(registry, stream, 0, stall_timeout)


def reattach(registry: Reattach, request: Request, stall_timeout: float) -> LogResponse:
    """``GET /v1/streams/{stream_id}``: the stream after the client's ``Last-Event-ID``."""
    stream_id = request.path_params["stream_id"]
    if not registry.enabled:
        raise APIError(
            404,
            "reattachable streams are off (start the server with --reattach-seconds)",
            param="stream_id",
        )
    unknown = sorted(request.query_params)  # the id and Last-Event-ID are all it takes
    if unknown:
        raise APIError(400, f"unknown query parameter {unknown[0]!r}", param=unknown[0])
    raw = request.headers.get("last-event-id", "0").strip() or "0"
    try:
        last = int(raw)
    except ValueError:
        raise APIError(400, f"Last-Event-ID must be an event id, not {raw!r}") from None
    key = request.scope.get("state", {}).get(KEY_STATE)
    try:
        cursor = registry.find(stream_id, key).first_after(last)
    except ValueError as exc:
        raise APIError(400, f"Last-Event-ID: {exc}", param="Last-Event-ID") from None
    stream = registry.attach(stream_id, key)
    return _reader(registry, stream, cursor, stall_timeout)
