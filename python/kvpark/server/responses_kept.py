"""Background responses and the routes that read stored ones back (OpenAI's convention).

- ``POST /v1/responses`` with ``background: true``: the response runs in a producer task of its
  own (server/stream_producer.py) into a log of its events, whoever is connected. With ``stream:
  true`` the POST reads that log from the start (a reader that leaves changes nothing); without,
  it answers at once with the response, ``status: "queued"``.
- ``GET /v1/responses/{id}``: the stored response as it stands (``queued``, ``in_progress`` with
  the output so far, or finished). ``?stream=true`` (a background response only): its events after
  sequence number ``starting_after`` (all of them without it), then the rest as they come.
- ``POST /v1/responses/{id}/cancel``: a running background response stops (its engine request is
  aborted, its cells come back): ``status: "cancelled"``, its stream ends after the last event it
  had. A finished one is answered as it is.
- ``DELETE /v1/responses/{id}``: forgotten (cancelled first if it runs).

A stored response is found only with the API key that made it (server/response_store.py).
These routes read what the server already holds, so they answer while it drains too: a client can
collect what it started before the server goes.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpark.server.auth import KEY_STATE
from kvpark.server.errors import APIError, bad_request
from kvpark.server.log_response import LogResponse
from kvpark.server.response_store import ResponseStore, StoredResponse
from kvpark.server.responses import JSON
from kvpark.server.responses_api_body import ResponsesBody, as_items
from kvpark.server.responses_api_events import ResponsesBuilder
from kvpark.server.stream_log import StreamLog
from kvpark.server.stream_producer import start_producer

if TYPE_CHECKING:
    from kvpark.server.pipeline import Prepared
    from kvpark.server.served_model import ServedModel

# the query parameters of GET /v1/responses/{id} (the openai client's retrieve() sends these)
QUERY = frozenset({"stream", "starting_after", "include", "include[]", "include_obfuscation"})


def start_background(
    routes: ServedModel,
    request: Request,
    prepared: Prepared[ResponsesBody, ResponsesBuilder],
    key: bytes | None,
) -> Response:
    store, builder = routes.response_store, prepared.builder
    stream = StreamLog(None, key, prepared.route.framing(builder))
    record = StoredResponse(prepared.request_id, key, True, live=builder.response, log=stream)
    items = tuple(prepared.body.input)

    def finished(final: JSON) -> None:
        store.finish(record, final, (*items, *as_items(final["output"])))

    def settle() -> None:
        """The producer is done: a response that did not end with its own last event failed
        before its first one (a full wait queue), was cancelled, or was ended by a shutdown."""
        if not record.running:
            return
        if stream.failure is not None:
            finished(builder.failed(stream.failure))
        elif record.cancelled:
            finished(builder.response("cancelled"))
        else:
            finished(builder.failed(APIError(500, "the response ended before its last event")))

    builder.on_end = finished
    # every event is logged, read or not: the store's bounds and max_output_tokens bound them
    fan_in = prepared.fan_in(0)
    frames = prepared.frames(fan_in, routes.config.sse_ping_interval)
    record.task = start_producer(stream, frames, routes.lifecycle, name=prepared.request_id)
    record.task.add_done_callback(lambda _: settle())
    record.settle = settle
    store.add(record)
    if prepared.req.stream:
        return LogResponse(stream, 0, routes.config.stall_timeout)  # type: ignore[return-value]
    return JSONResponse(record.current())


async def retrieve_response(routes: ServedModel, request: Request) -> Response:
    stream, starting_after = _query(request)
    record = _find(routes, request)
    if not stream:
        if starting_after is not None:
            raise bad_request("starting_after is for stream=true", "starting_after")
        return JSONResponse(record.current())
    if record.log is None:
        raise bad_request(
            "only a response made with background: true can be streamed again", "stream"
        )
    try:  # event k of the log is sequence number k - 1
        cursor = record.log.first_after(0 if starting_after is None else starting_after + 1)
    except ValueError:
        raise bad_request(
            f"starting_after {starting_after} is past the last event so far "
            f"(sequence number {record.log.events - 1})",
            "starting_after",
        ) from None
    reader = LogResponse(record.log, cursor, routes.config.stall_timeout)
    return reader  # type: ignore[return-value]  # an ASGI app like any Response


async def cancel_response(routes: ServedModel, request: Request) -> Response:
    record = _find(routes, request)
    if not record.background:
        raise bad_request("only a response made with background: true can be cancelled")
    await _cancel(record)
    return JSONResponse(record.current())


async def delete_response(routes: ServedModel, request: Request) -> Response:
    record = _find(routes, request)
    await _cancel(record)
    routes.response_store.remove(record.response_id)
    return JSONResponse({"id": record.response_id, "object": "response.deleted", "deleted": True})


async def close_background(store: ResponseStore) -> None:
    """The server is going: every running background response cancelled."""
    await asyncio.gather(*(_cancel(record) for record in store.running()))


async def _cancel(record: StoredResponse) -> None:
    task = record.task
    if task is None or not record.running:
        return
    record.cancelled = True
    task.cancel()  # closes its frames: the engine request is aborted
    await asyncio.gather(task, return_exceptions=True)
    if record.settle is not None:
        record.settle()  # at once, not when the loop gets to the task's callbacks


def _find(routes: ServedModel, request: Request) -> StoredResponse:
    key = request.scope.get("state", {}).get(KEY_STATE)
    return routes.response_store.get(request.path_params["response_id"], key)


def _query(request: Request) -> tuple[bool, int | None]:
    """``stream`` and ``starting_after``; ``include`` is refused unless empty (as on the POST),
    ``include_obfuscation`` accepted (no event carries an ``obfuscation`` field here), anything
    else a 400 naming it."""
    params = request.query_params
    for name in params:
        if name not in QUERY:
            raise bad_request(f"unknown query parameter {name!r}", name)
    if any(params.getlist("include") + params.getlist("include[]")):
        raise bad_request("include is not supported", "include")
    _flag(request, "include_obfuscation")
    stream = _flag(request, "stream")
    raw = params.get("starting_after")
    if raw is None:
        return stream, None
    if not raw.isdigit():
        raise bad_request(
            f"starting_after must be a sequence number, not {raw!r}", "starting_after"
        )
    return stream, int(raw)


def _flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return False
    if raw not in ("true", "false"):
        raise bad_request(f"{name} must be true or false, not {raw!r}", name)
    return raw == "true"
