"""``POST /v1/responses``: the OpenAI Responses API on the chat path.

The body is validated (:mod:`responses_api_body`), translated into a chat-completions body and
parsed by ``parse_chat`` like a chat request, so templates, tools, grammars and sampling are the
chat route's. It runs through :mod:`pipeline` as a chat request does (every prompt checked off the
event loop before anything streams, a :class:`FanIn` whose exit aborts the work of a client that
went away); :mod:`responses_api_events` renders the Responses objects and events. A stream is
typed SSE (``event: <type>`` + ``data:``) without ``[DONE]``; the park notices, pings and
``: queued N`` comments ride it exactly as they ride a chat stream. Errors are OpenAI-shaped,
in-stream as an ``error`` event.

OpenAI's storage convention (server/response_store.py): ``store`` (true by default while the
store is on) keeps the finished response; ``previous_response_id`` puts a stored response's
conversation (its input items, then its output items) before this request's input, so the
rendered prompt starts with the one the stored response was generated from and the prefix cache
supplies its pages; ``background`` runs the response apart from its connection
(server/responses_kept.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from kvpark.server.auth import KEY_STATE
from kvpark.server.errors import APIError, bad_request
from kvpark.server.pipeline import Answering, GenerationRoute, answer, prepare
from kvpark.server.protocol import GenerationRequest, TokenizerLike, parse_chat
from kvpark.server.response_store import ResponseStore, StoredResponse
from kvpark.server.responses import JSON
from kvpark.server.responses_api_body import (
    ResponsesBody,
    as_items,
    chat_error,
    parse_responses_body,
    to_chat,
)
from kvpark.server.responses_api_events import ResponsesBuilder
from kvpark.server.responses_kept import start_background
from kvpark.server.sse import Framing, typed_frame

if TYPE_CHECKING:
    from kvpark.server.served_model import ServedModel


async def create_response(routes: ServedModel, request: Request) -> Response:
    key = request.scope.get("state", {}).get(KEY_STATE)
    store = routes.response_store
    prepared = await prepare(routes, request, responses_route(store, key))
    body, builder = prepared.body, prepared.builder
    if body.background:
        return start_background(routes, request, prepared, key)
    if stores(body, store):
        items = tuple(body.input)
        response_id = prepared.request_id

        def keep(final: JSON) -> None:
            output = as_items(final["output"])
            store.add(StoredResponse(response_id, key, False, (*items, *output), final))

        builder.on_end = keep
    return await answer(routes, request, prepared)


def stores(body: ResponsesBody, store: ResponseStore) -> bool:
    """Whether the response is kept: ``store`` as asked, OpenAI's default (true) while the store
    is on."""
    return store.enabled if body.store is None else body.store


def responses_route(
    store: ResponseStore, key: bytes | None
) -> GenerationRoute[ResponsesBody, ResponsesBuilder]:
    """The route for one request: its body continued from a stored response, with this request's
    API key (another key's responses are not found)."""

    def body(raw: dict[str, object]) -> ResponsesBody:
        return continued(parse_responses_body(raw), store, key)

    def builder(
        body: ResponsesBody, req: GenerationRequest, answering: Answering
    ) -> ResponsesBuilder:
        return _builder(body, req, answering, stores(body, store))

    return replace(RESPONSES, body=body, builder=builder)


def continued(body: ResponsesBody, store: ResponseStore, key: bytes | None) -> ResponsesBody:
    """``store``, ``background`` and ``previous_response_id`` checked against the store; the
    stored conversation before ``input``. On a worker thread."""
    off = "the server keeps no responses (--response-store 0)"
    if body.store and not store.enabled:
        raise bad_request(f"store: true is not supported here: {off}", "store")
    if body.background and not store.enabled:
        raise bad_request(f"background: true needs the response store: {off}", "background")
    if body.background and body.store is False:
        raise bad_request(
            "background: true needs store: true (a background response is read back by its id)",
            "background",
        )
    previous = body.previous_response_id
    if previous is None:
        return body
    try:
        record = store.get(previous, key, "previous_response_id")
    except APIError as missing:  # the field names what cannot be found: OpenAI's 400
        raise bad_request(missing.message, "previous_response_id") from None
    if record.running:
        raise bad_request(
            f"response {previous!r} has not finished: continue it once it has",
            "previous_response_id",
        )
    # instructions are not carried over (OpenAI's rule): the stored items hold none
    return body.model_copy(update={"input": [*record.items, *body.input]})


def _model(body: ResponsesBody) -> str | None:
    return body.model


def _parse(body: ResponsesBody, tokenizer: TokenizerLike, max_model_len: int) -> GenerationRequest:
    return parse_chat(to_chat(body), tokenizer, max_model_len)


def _builder(
    body: ResponsesBody, req: GenerationRequest, answering: Answering, stored: bool = False
) -> ResponsesBuilder:
    return ResponsesBuilder(
        answering.request_id,
        answering.model_name,
        _echo(body, req, stored),
        None if req.tools is None else req.tools.parser(),
        with_preempt=answering.with_preempt,
    )


def _framing(builder: ResponsesBuilder) -> Framing:
    return Framing(
        frame=typed_frame,
        error=lambda error: b"".join(map(typed_frame, builder.failed_events(error))),
        done=b"",
    )


def _answer(builder: ResponsesBuilder) -> JSON:
    builder.closing_chunks()  # closes the open items (and takes what the tool parser held)
    return builder.response()


RESPONSES: GenerationRoute[ResponsesBody, ResponsesBuilder] = GenerationRoute(
    id_prefix="resp_",
    body=parse_responses_body,
    model=_model,
    parse=_parse,
    builder=_builder,  # without a store; responses_route() makes each request's
    framing=_framing,
    renamed=chat_error,
    answer=_answer,
)


def _echo(body: ResponsesBody, req: GenerationRequest, stored: bool) -> JSON:
    """The request's settings as the response object repeats them (the ``openai`` client's
    ``Response`` type has them all)."""
    params = req.params[0]
    tools = [] if body.tools is None else [t.model_dump(exclude_none=True) for t in body.tools]
    choice = body.tool_choice
    text = (
        {"format": {"type": "text"}} if body.text is None else body.text.model_dump(by_alias=True)
    )
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "tools": tools,
        "tool_choice": "auto"
        if choice is None
        else choice
        if isinstance(choice, str)
        else choice.model_dump(),
        "parallel_tool_calls": True
        if body.parallel_tool_calls is None
        else body.parallel_tool_calls,
        "text": text,
        "truncation": "disabled",
        "store": stored,
        "background": bool(body.background),
        "previous_response_id": body.previous_response_id,
        "reasoning": None,
        "metadata": body.metadata or {},
        "user": body.user,
        "service_tier": body.service_tier,
    }
