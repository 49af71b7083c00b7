"""The one served model as the routes see it: the engine and the server's config, the names a
request may give for the model, and whether the engine is ready. The route modules (pipeline.py,
messages_api.py, responses_api.py) take this, and app.py's handlers build on it, so no route
module names app.py, which imports them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpark.config.layers import ServerConfig
from kvpark.server.errors import APIError
from kvpark.server.kept_metrics import KeptCollector
from kvpark.server.lifecycle import SHUTTING_DOWN, Lifecycle
from kvpark.server.metrics import ServerMetrics
from kvpark.server.pool_feed import PoolCollector, PoolHub
from kvpark.server.reattach import Reattach
from kvpark.server.response_store import MIB, ResponseStore

if TYPE_CHECKING:
    from kvpark.engine.async_engine import AsyncEngine

# what clients that do not know the model's name send (the README's example among them)
DEFAULT_MODEL_ALIAS = "default"


class ServedModel:
    """One engine and one server config, with the checks every route makes."""

    def __init__(
        self, engine: AsyncEngine, config: ServerConfig, lifecycle: Lifecycle | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.lifecycle = lifecycle or Lifecycle()
        self.metrics = ServerMetrics(engine)
        # streams that outlive their connection (--reattach-seconds; off at 0)
        self.reattach = Reattach(config.reattach_seconds, config.stream_buffer, self.lifecycle)
        # /v1/responses kept for GET, previous_response_id and background (--response-store)
        self.response_store = ResponseStore(
            config.response_store, config.response_store_mib * MIB, config.response_store_ttl
        )
        self.metrics.registry.register(KeptCollector(self.reattach, self.response_store))
        # GET /v1/pool/events: one subscription to the engine's snapshots for every viewer
        self.pool_hub = PoolHub(engine)
        self.metrics.registry.register(PoolCollector(self.pool_hub))

    def ready_engine(self) -> AsyncEngine:
        """The engine, or the 503 (500 for a model that failed to load) every route answers
        instead: loading, draining, or an engine that has failed."""
        if self.engine.failure is not None:
            raise APIError(503, f"the engine failed: {self.engine.failure}", "unavailable_error")
        if self.lifecycle.draining:
            raise APIError(503, SHUTTING_DOWN, "unavailable_error")
        if self.engine.load_error is not None:
            raise APIError(500, f"the model failed to load: {self.engine.load_error}")
        if not self.engine.ready:
            raise APIError(503, "the model is loading", "unavailable_error")
        return self.engine

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.engine.model_name

    def model_aliases(self) -> frozenset[str]:
        """Every name a request may give for the one served model."""
        return frozenset({self.model_name, self.engine.model_name, DEFAULT_MODEL_ALIAS})

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_aliases():
            raise APIError(
                404,
                f"model {model!r} not found; this server's model answers to "
                + ", ".join(repr(name) for name in sorted(self.model_aliases())),
                "not_found_error",
                "model",
            )

    def preempt_enabled(self) -> bool:
        """Whether responses carry the ``preempt`` record: preemption is on (not --no-preempt)."""
        return self.engine.config.scheduler.preempt
