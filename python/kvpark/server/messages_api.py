"""``POST /v1/messages``: the Anthropic Messages API on the served model.

The body is validated as :class:`MessagesBody` (an unknown or bad field is a 400 naming it),
translated into a chat-completions body and parsed by the chat parser, so the prompt, tools and
sampling are exactly ``/v1/chat/completions``'s. Every prompt is checked by the engine before
anything streams. Events come back in Anthropic's shapes (:class:`MessageBuilder`); park notices,
pings and ``: queued N`` ride the stream as SSE comments, as on every streaming route. Every error
on this route, 401 included (:mod:`kvpark.server.auth`), is in Anthropic's shape.
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
from kvpark.server.errors import APIError, log
from kvpark.server.fanout import FanIn
from kvpark.server.messages_api_body import MessagesBody
from kvpark.server.messages_api_chat import chat_body
from kvpark.server.messages_api_errors import ANTHROPIC, anthropic_error_response
from kvpark.server.messages_api_events import MessageBuilder
from kvpark.server.protocol import parse_chat
from kvpark.server.relay import collect, stream_frames
from kvpark.server.schema import parse_body
from kvpark.server.sse import SSEResponse

if TYPE_CHECKING:
    from kvpark.server.app import Routes

# every method reaches the handler, so a wrong one is a 405 in Anthropic's shape too
METHODS = ["POST", "GET", "PUT", "PATCH", "DELETE"]
# chat fields whose errors should name the Anthropic field the client sent
RENAMED = {
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "response_format": "output_config.format",
}


async def create_message(routes: Routes, request: Request) -> Response:
    """The route's handler: every refusal and failure in Anthropic's error shape."""
    try:
        if request.method != "POST":
            raise APIError(405, f"method {request.method} not allowed on {request.url.path}")
        return await _create(routes, request)
    except APIError as error:
        return anthropic_error_response(error)
    except Exception as exc:  # a bug: logged, answered, and the server keeps serving
        log.error("internal error on POST /v1/messages", exc_info=exc)
        failure = APIError(500, f"internal server error: {type(exc).__name__}")
        return anthropic_error_response(failure)


async def _create(routes: Routes, request: Request) -> Response:
    engine = routes.ready_engine()
    body = parse_body(MessagesBody, await read_json(request, routes.config.max_body_bytes))
    routes.check_model(body.model)
    try:
        # Templates and tokenizing a long prompt take a while: off the event loop.
        req = await run_in_threadpool(
            parse_chat, chat_body(body), engine.tokenizer, engine.max_model_len
        )
    except APIError as error:
        raise _renamed(error) from None
    for prompt, params in zip(req.prompts, req.params, strict=True):
        try:
            await run_in_threadpool(engine.check_request, prompt, params)  # compiles grammars
        except RequestRejected as exc:
            raise _renamed(APIError(exc.code, exc.message, exc.kind, exc.param)) from None
    message_id = f"msg_{uuid.uuid4().hex}"
    builder = MessageBuilder(
        message_id,
        routes.model_name,
        len(req.prompts[0]),
        req.params[0].stop,
        engine.tokenizer,
        req.tools,
        with_preempt=routes.preempt_enabled(),
    )
    fan_in = FanIn(engine.generate, req.prompts, req.params, message_id, RequestRejected)
    if body.stream:
        interval = routes.config.sse_ping_interval
        frames = stream_frames(engine, fan_in, builder, interval, False, ANTHROPIC)
        return SSEResponse(frames, ANTHROPIC)  # type: ignore[return-value]
    if await unless_disconnected(request.receive, collect(fan_in, builder)) is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(builder.response())


def _renamed(error: APIError) -> APIError:
    name = RENAMED.get(error.param or "")
    if name is None:
        return error
    return APIError(error.status, f"{name}: {error.message}", error.kind, name)
