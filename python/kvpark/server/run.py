"""``kvpark serve``: uvicorn on host:port, with the model loading in the background.

The socket is bound at once; ``/health`` answers 503 until the engine is ready. If loading fails,
the error is logged and the process exits with status 1 instead of serving 500s forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import TYPE_CHECKING

import uvicorn

from kvpark import env
from kvpark.config import EngineConfig, ServerConfig
from kvpark.server.app import build_app

if TYPE_CHECKING:
    from kvpark.async_engine import AsyncEngine

log = logging.getLogger("kvpark.server")
LOAD_POLL_S = 0.1
GRACEFUL_SHUTDOWN_S = 5


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(log_format: str, level: str | None = None) -> None:
    """Route kvpark's and uvicorn's logs to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or env.raw("KVPARK_LOG_LEVEL")).upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Run the server until it is stopped; the process exit status."""
    from kvpark.async_engine import AsyncEngine  # torch and the model code: only when serving

    configure_logging(server_config.log_format)
    engine = AsyncEngine(engine_config)
    app = build_app(engine, server_config)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    return asyncio.run(_serve(server, engine, server_config))


async def _serve(server: uvicorn.Server, engine: AsyncEngine, config: ServerConfig) -> int:
    watcher = asyncio.create_task(_watch_loading(server, engine, config))
    try:
        await server.serve()
    finally:
        watcher.cancel()
    return 1 if engine.load_error is not None else 0


async def _watch_loading(server: uvicorn.Server, engine: AsyncEngine, config: ServerConfig) -> None:
    while not engine.ready:
        if engine.load_error is not None:
            log.error("the model failed to load: %s", engine.load_error)
            server.should_exit = True
            return
        await asyncio.sleep(LOAD_POLL_S)
    log.info("ready: serving %s on http://%s:%d", engine.model_name, config.host, config.port)
