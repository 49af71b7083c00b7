"""``POST /v1/responses``: the OpenAI Responses API on the chat path.

The body is validated (:mod:`responses_api_body`), translated into a chat-completions body and
parsed by ``parse_chat`` like a chat request, so templates, tools, grammars and sampling are the
chat route's. The engine runs it as ``Routes._generate`` runs a chat request (every prompt checked
before anything streams, a :class:`FanIn` whose exit aborts the work of a client that went away);
:mod:`responses_api_events` renders the Responses objects and events. A stream is typed SSE
(``event: <type>`` + ``data:``) without ``[DONE]``; the park notices, pings and ``: queued N``
comments ride it exactly as they ride a chat stream. Errors are OpenAI-shaped, in-stream as an
``error`` event.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpark.engine.llm_engine import RequestRejected
from kvpark.server.body import read_json
from kvpark.server.disconnect import unless_disconnected
from kvpark.server.errors import APIError
from kvpark.server.fanout import FanIn
from kvpark.server.protocol import GenerationRequest, parse_chat
from kvpark.server.relay import collect, stream_frames
from kvpark.server.responses import JSON
from kvpark.server.responses_api_body import (
    ResponsesBody,
    chat_error,
    parse_responses_body,
    to_chat,
)
from kvpark.server.responses_api_events import ResponsesBuilder
from kvpark.server.sse import Framing, SSEResponse, typed_frame
from kvpark.server.tools import ToolPlan

if TYPE_CHECKING:
    from kvpark.server.app import Routes


async def create_response(routes: Routes, request: Request) -> Response:
    engine = routes.ready_engine()
    body = parse_responses_body(await read_json(request, routes.config.max_body_bytes))
    routes.check_model(body.model)
    try:
        # Templates and tokenizing a long prompt take a while: off the event loop.
        req = await run_in_threadpool(
            parse_chat, to_chat(body), engine.tokenizer, engine.max_model_len
        )
        for prompt, params in zip(req.prompts, req.params, strict=True):
            try:
                engine.check_request(prompt, params)
            except RequestRejected as exc:
                raise APIError(exc.code, exc.message, exc.kind, exc.param) from None
    except APIError as error:
        raise chat_error(error) from None
    response_id = f"resp_{uuid.uuid4().hex}"
    plan: ToolPlan | None = getattr(req, "tools", None)  # the chat parser's tool plan, if any
    builder = ResponsesBuilder(
        response_id,
        routes.model_name,
        _echo(body, req),
        None if plan is None else plan.parser(),
        with_preempt=routes.preempt_enabled(),
    )
    fan_in = FanIn(engine.generate, req.prompts, req.params, response_id, RequestRejected)
    if req.stream:
        framing = Framing(
            frame=typed_frame,
            error=lambda error: typed_frame(builder.error_event(error)),
            done=b"",
        )
        interval = routes.config.sse_ping_interval
        frames = stream_frames(engine, fan_in, builder, interval, False, framing)
        return SSEResponse(frames, framing)  # type: ignore[return-value]
    if await unless_disconnected(request.receive, collect(fan_in, builder)) is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    builder.closing_chunks()  # closes the open items (and takes what the tool parser held)
    return JSONResponse(builder.response())


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
