"""HTTP routes: OpenAI completions and chat, tokenizer utilities, health, props, slots, metrics,
the pool's event stream and the two web pages.

The server never touches the pool or tensors. Every generating route (chat, completions, Responses,
Messages) runs through :mod:`pipeline`: it parses, asks ``engine.check_request`` about every prompt
of a request off the event loop before generating any (so a refusal is a plain 4xx before anything
streams or parks), then relays the engine's events. A client that goes away cancels its work, which
aborts its engine requests.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvpark.config.layers import ServerConfig
from kvpark.server.auth import APIKeyMiddleware
from kvpark.server.body import read_json
from kvpark.server.embeddings import create_embeddings
from kvpark.server.errors import (
    RETRY_AFTER_SECONDS,
    APIError,
    api_error_response,
    http_error_response,
    internal_error_response,
    log,
)
from kvpark.server.lifecycle import InFlight, Lifecycle
from kvpark.server.messages_api import METHODS as MESSAGES_METHODS
from kvpark.server.messages_api import create_message
from kvpark.server.metrics import CONTENT_TYPE
from kvpark.server.openai_api import CHAT, COMPLETIONS
from kvpark.server.pipeline import generate
from kvpark.server.pool_events import PoolEvents
from kvpark.server.reattach_response import reattach
from kvpark.server.responses_api import create_response
from kvpark.server.responses_kept import (
    cancel_response,
    close_background,
    delete_response,
    retrieve_response,
)
from kvpark.server.served_model import ServedModel
from kvpark.server.tokenize_api import detokenize, tokenize
from kvpark.server.web_pages import WebPages, is_open

if TYPE_CHECKING:
    from kvpark.engine.async_engine import AsyncEngine

Handler = Callable[[Request], Awaitable[Response]]
RETRY_AFTER = {"Retry-After": str(RETRY_AFTER_SECONDS)}


class Routes(ServedModel):
    """The handlers, bound to one engine and one server config."""

    # -- generation -----------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await generate(self, request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await generate(self, request, COMPLETIONS)

    async def responses(self, request: Request) -> Response:
        return await create_response(self, request)

    async def messages(self, request: Request) -> Response:  # Anthropic's errors, all methods
        return await create_message(self, request)

    async def stream(self, request: Request) -> Response:  # GET /v1/streams/{stream_id}
        # no ready_engine(): a stream already started is read while the server drains too
        reader = reattach(self.reattach, request, self.config.stall_timeout)
        return reader  # type: ignore[return-value]  # an ASGI app like any Response

    async def response(self, request: Request) -> Response:  # GET, DELETE /v1/responses/{id}
        if request.method == "DELETE":
            return await delete_response(self, request)
        return await retrieve_response(self, request)

    async def cancel_response(self, request: Request) -> Response:
        return await cancel_response(self, request)

    async def embeddings(self, request: Request) -> Response:
        engine = self.ready_engine()
        body = await read_json(request, self.config.max_body_bytes)
        return await create_embeddings(engine, request, body, self.check_model, self.model_name)

    # -- utilities ------------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        engine = self.ready_engine()
        body = await read_json(request, self.config.max_body_bytes)
        return JSONResponse(await tokenize(body, engine.tokenizer))

    async def detokenize(self, request: Request) -> Response:
        engine = self.ready_engine()
        body = await read_json(request, self.config.max_body_bytes)
        return JSONResponse(detokenize(body, engine.tokenizer))

    async def health(self, request: Request) -> Response:
        if self.engine.failure is not None:
            body = {"status": "failed", "reason": self.engine.failure}
            return JSONResponse(body, status_code=503, headers=RETRY_AFTER)
        if self.lifecycle.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers=RETRY_AFTER)
        self.ready_engine()
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        self.ready_engine()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self.ready_engine()
        self.check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, object]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvpark",
            "max_model_len": self.engine.max_model_len,
        }

    async def props(self, request: Request) -> Response:
        return JSONResponse(self.ready_engine().props())

    async def slots(self, request: Request) -> Response:
        return JSONResponse(self.ready_engine().slots())

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def pool_events(self, request: Request) -> Response:  # GET /v1/pool/events
        self.ready_engine()
        viewer = PoolEvents(self.pool_hub, self.lifecycle, self.config.stall_timeout)
        return viewer  # type: ignore[return-value]  # an ASGI app like any Response


def _guard(handler: Handler) -> Handler:
    """Turn a bug in a handler into a logged 500, without Starlette re-raising it to the server."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError:
            raise
        except Exception as exc:
            return await internal_error_response(request, exc)

    return guarded


def build_app(
    engine: AsyncEngine,
    server_config: ServerConfig,
    start_engine: bool = True,
    lifecycle: Lifecycle | None = None,
) -> Starlette:
    """The ASGI app. With ``start_engine`` its lifespan starts the engine (the model loads in the
    background; ``/health`` answers 503 until it is ready) and shuts it down at exit.
    ``lifecycle``: the draining and in-flight state the server's supervisor shares (a fresh one
    otherwise)."""
    lifecycle = lifecycle or Lifecycle()
    r = Routes(engine, server_config, lifecycle)
    routes = [
        Route("/health", _guard(r.health), methods=["GET"]),
        Route("/v1/models", _guard(r.models), methods=["GET"]),
        Route("/v1/models/{model:path}", _guard(r.model), methods=["GET"]),
        Route("/v1/chat/completions", _guard(r.chat_completions), methods=["POST"]),
        Route("/v1/completions", _guard(r.completions), methods=["POST"]),
        Route("/v1/embeddings", _guard(r.embeddings), methods=["POST"]),
        Route("/v1/responses", _guard(r.responses), methods=["POST"]),
        Route("/v1/messages", _guard(r.messages), methods=MESSAGES_METHODS),
        Route("/v1/responses/{response_id}", _guard(r.response), methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/cancel", _guard(r.cancel_response), methods=["POST"]),
        Route("/v1/streams/{stream_id}", _guard(r.stream), methods=["GET"]),
        Route("/tokenize", _guard(r.tokenize), methods=["POST"]),
        Route("/detokenize", _guard(r.detokenize), methods=["POST"]),
        Route("/props", _guard(r.props), methods=["GET"]),
        Route("/slots", _guard(r.slots), methods=["GET"]),
        Route("/metrics", _guard(r.metrics_text), methods=["GET"]),
        Route("/v1/pool/events", _guard(r.pool_events), methods=["GET"]),
    ]
    if server_config.web:  # the chat page and the pool view (docs/web.md); off: --no-web
        web = WebPages(auth=bool(server_config.api_keys))
        routes += [
            Route("/", _guard(web.page), methods=["GET"]),
            Route("/pool", _guard(web.page), methods=["GET"]),
            Route("/web/{name}", _guard(web.asset), methods=["GET"]),
        ]
    middleware = [Middleware(InFlight, lifecycle=lifecycle)]
    if server_config.api_keys:
        also_open = is_open if server_config.web else None
        middleware.append(
            Middleware(APIKeyMiddleware, api_keys=server_config.api_keys, also_open=also_open)
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if start_engine:
            engine.start()
        try:
            yield
        finally:
            r.pool_hub.close()
            await r.reattach.close()
            await close_background(r.response_store)
            if start_engine:
                log.info("shutting down the engine")
                await engine.shutdown()

    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            APIError: api_error_response,
            HTTPException: http_error_response,
            Exception: internal_error_response,
        },
        lifespan=lifespan,
    )
