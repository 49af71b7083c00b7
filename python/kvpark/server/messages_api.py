"""``POST /v1/messages``: the Anthropic Messages API on the served model.

The body is validated as :class:`MessagesBody` (an unknown or bad field is a 400 naming it),
translated into a chat-completions body and parsed by the chat parser, so the prompt, tools and
sampling are exactly ``/v1/chat/completions``'s, and it runs through :mod:`pipeline` like them:
every prompt is checked by the engine, off the event loop, before anything streams. Events come
back in Anthropic's shapes (:class:`MessageBuilder`); park notices, pings and ``: queued N`` ride
the stream as SSE comments, as on every streaming route. Every error
on this route, 401 included (:mod:`kvpark.server.auth`), is in Anthropic's shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from kvpark.server.errors import APIError, log
from kvpark.server.messages_api_body import MessagesBody
from kvpark.server.messages_api_chat import chat_body
from kvpark.server.messages_api_errors import ANTHROPIC, anthropic_error_response
from kvpark.server.messages_api_events import MessageBuilder
from kvpark.server.pipeline import Answering, GenerationRoute, generate
from kvpark.server.protocol import GenerationRequest, TokenizerLike, parse_chat
from kvpark.server.schema import parse_body
from kvpark.server.sse import Framing

if TYPE_CHECKING:
    from kvpark.server.served_model import ServedModel

# every method reaches the handler, so a wrong one is a 405 in Anthropic's shape too
METHODS = ["POST", "GET", "PUT", "PATCH", "DELETE"]
# chat fields whose errors should name the Anthropic field the client sent
RENAMED = {
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "response_format": "output_config.format",
}


async def create_message(routes: ServedModel, request: Request) -> Response:
    """The route's handler: every refusal and failure in Anthropic's error shape."""
    try:
        if request.method != "POST":
            raise APIError(405, f"method {request.method} not allowed on {request.url.path}")
        return await generate(routes, request, MESSAGES)
    except APIError as error:
        return anthropic_error_response(error)
    except Exception as exc:  # a bug: logged, answered, and the server keeps serving
        log.error("internal error on POST /v1/messages", exc_info=exc)
        failure = APIError(500, f"internal server error: {type(exc).__name__}")
        return anthropic_error_response(failure)


def _body(raw: dict[str, object]) -> MessagesBody:
    return parse_body(MessagesBody, raw)


def _model(body: MessagesBody) -> str | None:
    return body.model


def _parse(body: MessagesBody, tokenizer: TokenizerLike, max_model_len: int) -> GenerationRequest:
    return parse_chat(chat_body(body), tokenizer, max_model_len)


def _builder(body: MessagesBody, req: GenerationRequest, answering: Answering) -> MessageBuilder:
    return MessageBuilder(
        answering.request_id,
        answering.model_name,
        len(req.prompts[0]),
        req.params[0].stop,
        answering.tokenizer,
        req.tools,
        with_preempt=answering.with_preempt,
    )


def _framing(builder: MessageBuilder) -> Framing:
    return ANTHROPIC


def _renamed(error: APIError) -> APIError:
    name = RENAMED.get(error.param or "")
    if name is None:
        return error
    return APIError(error.status, f"{name}: {error.message}", error.kind, name)


MESSAGES: GenerationRoute[MessagesBody, MessageBuilder] = GenerationRoute(
    id_prefix="msg_",
    body=_body,
    model=_model,
    parse=_parse,
    builder=_builder,
    framing=_framing,
    renamed=_renamed,
)
