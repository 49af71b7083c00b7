"""One generating request, whichever API it came in by: chat, completions, Responses, Messages.

Every such route runs the same steps: a ready engine, the body read within its limit, then (off the
event loop: templates, tokenizing and the grammars ``check_request`` compiles take a while) the
body validated, its model checked, parsed into a :class:`GenerationRequest` and every prompt
checked by the engine, so a refusal is a plain 4xx before anything streams or parks. Then one
:class:`FanIn` over ``engine.generate``, relayed as a stream or collected into one object (a client
that leaves first gets a 499 nobody reads, and its work is aborted). A route brings only what is
its own, as a :class:`GenerationRoute`: its body, its parser, its event builder, its id prefix, its
stream framing and the names its errors give.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpark.engine.llm_engine import RequestRejected
from kvpark.server.auth import KEY_STATE
from kvpark.server.body import read_json
from kvpark.server.cache_salt import request_salt
from kvpark.server.disconnect import unless_disconnected
from kvpark.server.errors import APIError
from kvpark.server.fanout import FanIn
from kvpark.server.protocol import GenerationRequest, TokenizerLike
from kvpark.server.relay import collect, stream_frames
from kvpark.server.responses import JSON
from kvpark.server.sse import OPENAI, Framing, SSEResponse, StreamBuilder

if TYPE_CHECKING:
    from kvpark.engine.async_engine import AsyncEngine
    from kvpark.server.served_model import ServedModel


class AnswerBuilder(StreamBuilder, Protocol):
    """A route's event builder: the stream's chunks, and the one object of a collected answer."""

    def response(self) -> JSON: ...


B = TypeVar("B")  # the route's validated body
A = TypeVar("A", bound=AnswerBuilder)


@dataclass(frozen=True)
class Answering:
    """What a route's builder is made with besides its body and request."""

    request_id: str
    model_name: str
    tokenizer: TokenizerLike
    with_preempt: bool


def _openai(builder: AnswerBuilder) -> Framing:
    return OPENAI


def _same(error: APIError) -> APIError:
    return error


def _response(builder: AnswerBuilder) -> JSON:
    return builder.response()


@dataclass(frozen=True)
class GenerationRoute(Generic[B, A]):
    """What one API brings to the pipeline; the rest is the same on every generating route."""

    id_prefix: str  # the request id is this and a random hex
    body: Callable[[dict[str, object]], B]  # the JSON object validated (a 400 naming the field)
    model: Callable[[B], str | None]  # the model the body names, if any
    parse: Callable[[B, TokenizerLike, int], GenerationRequest]  # tokenizer, max_model_len
    builder: Callable[[B, GenerationRequest, Answering], A]
    framing: Callable[[A], Framing] = _openai
    # a refusal of the parser or the engine, its field named as this API's client named it
    renamed: Callable[[APIError], APIError] = _same
    # the collected answer, once every event is in
    answer: Callable[[A], JSON] = _response


async def generate(routes: ServedModel, request: Request, route: GenerationRoute[B, A]) -> Response:
    """The route's answer: a stream (``SSEResponse``) or one JSON object."""
    engine = routes.ready_engine()
    raw = await read_json(request, routes.config.max_body_bytes)
    key = request.scope.get("state", {}).get(KEY_STATE) if routes.config.cache_salt_by_key else None
    body, req = await run_in_threadpool(_prepare, routes, engine, route, raw, key)
    request_id = f"{route.id_prefix}{uuid.uuid4().hex}"
    answering = Answering(request_id, routes.model_name, engine.tokenizer, routes.preempt_enabled())
    builder = route.builder(body, req, answering)
    config = routes.config
    # a collected answer takes every event as it comes: only a stream can fall behind
    limit = config.stream_buffer if req.stream else 0
    fan_in = FanIn(engine.generate, req.prompts, req.params, request_id, RequestRejected, limit)
    if req.stream:
        # An ASGI app like any Response, with its own disconnect handling.
        framing = route.framing(builder)
        interval = config.sse_ping_interval
        frames = stream_frames(engine, fan_in, builder, interval, len(req.prompts) > 1, framing)
        response = SSEResponse(frames, framing, config.stall_timeout, request_id)
        return response  # type: ignore[return-value]
    if await unless_disconnected(request.receive, collect(fan_in, builder)) is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(route.answer(builder))


def _prepare(
    routes: ServedModel,
    engine: AsyncEngine,
    route: GenerationRoute[B, A],
    raw: dict[str, object],
    key_digest: bytes | None,
) -> tuple[B, GenerationRequest]:
    """On a worker thread: the body validated and parsed, its cache salt (with the API key's
    digest under ``--cache-salt-by-key``) folded into every prompt's params, every prompt checked
    by the engine.

    Validation only: whether the wait queue has room is decided on the engine thread as the prompts
    are added (a full queue's 503 is then their first event, still a plain answer)."""
    body = route.body(raw)
    routes.check_model(route.model(body))
    try:
        req = route.parse(body, engine.tokenizer, engine.max_model_len)
        salt = request_salt(req.cache_salt, key_digest)
        if salt:
            req = replace(req, params=[replace(p, cache_salt=salt) for p in req.params])
        for prompt, params in zip(req.prompts, req.params, strict=True):
            try:
                engine.check_request(prompt, params)  # compiles grammars
            except RequestRejected as exc:
                raise APIError(exc.code, exc.message, exc.kind, exc.param) from None
    except APIError as error:
        raise route.renamed(error) from None
    return body, req
