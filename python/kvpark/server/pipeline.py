"""One generating request, whichever API it came in by: chat, completions, Responses, Messages.

Every such route runs the same steps: a ready engine, the body read within its limit, then (off the
event loop: templates, tokenizing and the grammars ``check_request`` compiles take a while) the
body validated, its model checked, parsed into a :class:`GenerationRequest` and every prompt
checked by the engine, so a refusal is a plain 4xx before anything streams or parks
(:func:`prepare`). Then one :class:`FanIn` over ``engine.generate``, relayed as a stream or
collected into one object (:func:`answer`; a client that leaves first gets a 499 nobody reads, and
its work is aborted). Under ``--reattach-seconds`` a stream runs in a producer task of its own and
outlives its connection (server/reattach.py); a route with more ways to answer (a background
response: server/responses_kept.py) calls :func:`prepare` and then its own. A route brings only
what is its own, as a :class:`GenerationRoute`: its body, its parser, its event builder, its id
prefix, its stream framing and the names its errors give.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator, Callable
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
from kvpark.server.reattach_response import start_reattachable
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


@dataclass
class Prepared(Generic[B, A]):
    """A request past every check, its builder made, nothing started yet."""

    route: GenerationRoute[B, A]
    engine: AsyncEngine
    body: B
    req: GenerationRequest
    builder: A
    request_id: str

    def fan_in(self, buffer_limit: int) -> FanIn:
        """The engine requests, one per prompt (``buffer_limit``: events a reader may leave
        unread before they are aborted; 0: no bound)."""
        req = self.req
        return FanIn(
            self.engine.generate,
            req.prompts,
            req.params,
            self.request_id,
            RequestRejected,
            buffer_limit,
        )

    def frames(self, fan_in: FanIn, ping_interval: float) -> AsyncGenerator[bytes, None]:
        """The stream's frames in the route's framing."""
        multi = len(self.req.prompts) > 1
        framing = self.route.framing(self.builder)
        return stream_frames(self.engine, fan_in, self.builder, ping_interval, multi, framing)


async def generate(routes: ServedModel, request: Request, route: GenerationRoute[B, A]) -> Response:
    """The route's answer: a stream or one JSON object."""
    return await answer(routes, request, await prepare(routes, request, route))


async def prepare(
    routes: ServedModel, request: Request, route: GenerationRoute[B, A]
) -> Prepared[B, A]:
    """The body read and checked (a refusal is a plain 4xx) and the route's builder made."""
    engine = routes.ready_engine()
    raw = await read_json(request, routes.config.max_body_bytes)
    key = request.scope.get("state", {}).get(KEY_STATE) if routes.config.cache_salt_by_key else None
    body, req = await run_in_threadpool(_prepare, routes, engine, route, raw, key)
    # 128 random bits: a stored response is found by this id alone (server/response_store.py)
    request_id = f"{route.id_prefix}{secrets.token_hex(16)}"
    answering = Answering(request_id, routes.model_name, engine.tokenizer, routes.preempt_enabled())
    builder = route.builder(body, req, answering)
    return Prepared(route, engine, body, req, builder, request_id)


async def answer(routes: ServedModel, request: Request, prepared: Prepared[B, A]) -> Response:
    """A plain stream (its connection's), a reattachable one (``--reattach-seconds``: it
    outlives its connection), or one JSON object once every event is in."""
    config = routes.config
    if not prepared.req.stream:
        fan_in = prepared.fan_in(0)  # a collected answer takes every event as it comes
        if await unless_disconnected(request.receive, collect(fan_in, prepared.builder)) is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(prepared.route.answer(prepared.builder))
    framing = prepared.route.framing(prepared.builder)
    if routes.reattach.enabled:
        # its producer takes every event as it comes; the bound is on its log instead
        fan_in = prepared.fan_in(0)
        frames = prepared.frames(fan_in, config.sse_ping_interval)
        reader = start_reattachable(
            routes.reattach, request, frames, framing, fan_in.give_up, config.stall_timeout
        )
        return reader  # type: ignore[return-value]  # an ASGI app like any Response
    fan_in = prepared.fan_in(config.stream_buffer)
    frames = prepared.frames(fan_in, config.sse_ping_interval)
    # an ASGI app like any Response, with its own disconnect handling
    response = SSEResponse(frames, framing, config.stall_timeout, prepared.request_id)
    return response  # type: ignore[return-value]


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
