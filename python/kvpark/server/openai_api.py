"""``POST /v1/chat/completions`` and ``POST /v1/completions`` as routes of the pipeline.

The body stays a JSON object until :mod:`protocol` parses it (the pydantic models of
:mod:`openai_bodies` validate it there); the events become OpenAI chunks and objects
(:class:`ResponseBuilder`, with :class:`EchoBuilder` in front for a completion with ``echo``).
"""

from __future__ import annotations

from kvpark.server.body import Fields
from kvpark.server.echo import EchoBuilder
from kvpark.server.pipeline import AnswerBuilder, Answering, GenerationRoute
from kvpark.server.protocol import GenerationRequest, parse_chat, parse_completion
from kvpark.server.responses import ResponseBuilder

JSONBody = dict[str, object]


def _as_read(body: JSONBody) -> JSONBody:
    return body


def _model(body: JSONBody) -> str | None:
    return Fields(body).string("model")


def _builder(body: JSONBody, req: GenerationRequest, answering: Answering) -> AnswerBuilder:
    response = ResponseBuilder(
        req.kind,
        answering.request_id,
        answering.model_name,
        len(req.prompts),
        req.n,
        answering.tokenizer,
        logprobs=req.params[0].logprobs is not None,
        include_usage=req.include_usage,
        with_preempt=answering.with_preempt,
        tools=req.tools,
    )
    return response if req.echo is None else EchoBuilder(response, req.echo)


CHAT: GenerationRoute[JSONBody, AnswerBuilder] = GenerationRoute(
    id_prefix="chatcmpl-", body=_as_read, model=_model, parse=parse_chat, builder=_builder
)
COMPLETIONS: GenerationRoute[JSONBody, AnswerBuilder] = GenerationRoute(
    id_prefix="cmpl-", body=_as_read, model=_model, parse=parse_completion, builder=_builder
)
