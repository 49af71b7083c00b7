"""``POST /v1/responses``: the OpenAI Responses API on the chat path.

The body is validated (:mod:`responses_api_body`), translated into a chat-completions body and
parsed by ``parse_chat`` like a chat request, so templates, tools, grammars and sampling are the
chat route's. It runs through :mod:`pipeline` as a chat request does (every prompt checked off the
event loop before anything streams, a :class:`FanIn` whose exit aborts the work of a client that
went away); :mod:`responses_api_events` renders the Responses objects and events. A stream is
typed SSE (``event: <type>`` + ``data:``) without ``[DONE]``; the park notices, pings and
``: queued N`` comments ride it exactly as they ride a chat stream. Errors are OpenAI-shaped,
in-stream as an ``error`` event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from kvpark.server.pipeline import Answering, GenerationRoute, generate
from kvpark.server.protocol import GenerationRequest, TokenizerLike, parse_chat
from kvpark.server.responses import JSON
from kvpark.server.responses_api_body import (
    ResponsesBody,
    chat_error,
    parse_responses_body,
    to_chat,
)
from kvpark.server.responses_api_events import ResponsesBuilder
from kvpark.server.sse import Framing, typed_frame

if TYPE_CHECKING:
    from kvpark.server.served_model import ServedModel


async def create_response(routes: ServedModel, request: Request) -> Response:
    return await generate(routes, request, RESPONSES)


def _model(body: ResponsesBody) -> str | None:
    return body.model


def _parse(body: ResponsesBody, tokenizer: TokenizerLike, max_model_len: int) -> GenerationRequest:
    return parse_chat(to_chat(body), tokenizer, max_model_len)


def _builder(body: ResponsesBody, req: GenerationRequest, answering: Answering) -> ResponsesBuilder:
    return ResponsesBuilder(
        answering.request_id,
        answering.model_name,
        _echo(body, req),
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
    builder=_builder,
    framing=_framing,
    renamed=chat_error,
    answer=_answer,
)


def _echo(body: ResponsesBody, req: GenerationRequest) -> JSON:
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
        "store": False,
        "previous_response_id": None,
        "reasoning": None,
        "metadata": body.metadata or {},
        "user": body.user,
        "service_tier": body.service_tier,
    }
