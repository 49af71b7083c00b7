"""``kvpark serve``: uvicorn on host:port, with the model loading in the background.

The socket is bound at once; ``/health`` answers 503 until the engine is ready. If loading fails,
the error is logged and the process exits with status 1 instead of serving 500s forever; so it
does, after its open requests have heard, when the engine fails later. SIGTERM and SIGINT drain
the server and exit 0 (server/supervisor.py).

Every request is access-logged except ``/health`` polls and ``/metrics`` scrapes (a load balancer or
Prometheus would otherwise fill the log; ``--log-health`` keeps them), and while requests run a
stats line comes every ``--log-stats-interval`` seconds (``stats_log.py``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn

from kvpark.config import env
from kvpark.config.env import Knobs
from kvpark.config.layers import EngineConfig, ServerConfig
from kvpark.server.app import build_app
from kvpark.server.lifecycle import Lifecycle
from kvpark.server.process_memory import (
    freeze_loaded_objects,
    limit_malloc_arenas,
    release_gpu_libraries,
)
from kvpark.server.stats_log import log_stats_every
from kvpark.server.supervisor import SupervisedServer, supervise

if TYPE_CHECKING:
    from kvpark.engine.async_engine import AsyncEngine

log = logging.getLogger("kvpark.server")
LOAD_POLL_S = 0.1
GRACEFUL_SHUTDOWN_S = 5  # uvicorn's own wait, after the drain (server/supervisor.py) is over
POLLED_PATHS = frozenset({"/health", "/metrics"})  # not access-logged unless --log-health


def http_stack(name: str) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """``--http-stack``: the event loop factory (None: asyncio's) and uvicorn's HTTP parser.

    Per token a stream costs the event loop a wake-up, a chunk's JSON and a socket write; at one
    chat through the pure-Python stack (asyncio + h11) that loop took ~0.6 ms a token on one of
    the two cores the kernel threads use, and single-stream decode through the server fell ~30 %
    below in-process (docs/benchmarks.md). uvloop and httptools (C) do the same work in less.
    ``auto`` takes them where both are installed (they are dependencies on Linux and macOS),
    ``asyncio`` is the off switch."""
    have = all(importlib.util.find_spec(m) is not None for m in ("uvloop", "httptools"))
    if name == "asyncio" or (name == "auto" and not have):
        return None, "h11"
    if not have:
        raise ValueError("--http-stack uvloop needs the uvloop and httptools packages")
    import uvloop

    return uvloop.new_event_loop, "httptools"


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


class PollFilter(logging.Filter):
    """Drop uvicorn's access lines for the polled paths; every other request is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: args = (client, method, path with query, http version, status)
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3:
            path = str(args[2]).partition("?")[0]
            return path not in POLLED_PATHS
        return True


def configure_logging(log_format: str, level: str | None = None, log_health: bool = False) -> None:
    """Route kvpark's and uvicorn's logs to stderr in the chosen format; ``log_health``: access-log
    the polled paths too."""
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
    access = logging.getLogger("uvicorn.access")
    for old in [f for f in access.filters if isinstance(f, PollFilter)]:
        access.removeFilter(old)  # configuring twice must not stack filters
    if not log_health:
        access.addFilter(PollFilter())


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Run the server until it is stopped; the process exit status."""
    limit_malloc_arenas()  # before the engine, the event loop and the request threads start
    from kvpark.engine.async_engine import (  # torch and the model code: only when serving
        AsyncEngine,
        device_type,
    )

    loop_factory, http = http_stack(server_config.http_stack)
    configure_logging(server_config.log_format, log_health=server_config.log_health)
    if device_type(engine_config) == "cpu" and Knobs.from_env().release_gpu_libs:
        released = release_gpu_libraries()  # before the model loads: the peak is what follows
        log.info("CPU server: the GPU libraries' pages handed back (%d mappings)", released)
    engine = AsyncEngine(engine_config)
    lifecycle = Lifecycle()
    app = build_app(engine, server_config, lifecycle=lifecycle)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_config=None,
        lifespan="on",
        http=http,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = SupervisedServer(config, lifecycle)
    log.info("http stack: %s + %s", "uvloop" if loop_factory else "asyncio", http)
    listening = listen_socket(config, server_config.send_buffer)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(server, engine, server_config, listening))


def listen_socket(config: uvicorn.Config, send_buffer: int) -> socket.socket:
    """The bound socket uvicorn serves on, its send buffer ``send_buffer`` bytes (0: the
    kernel's). Linux hands a listening socket's buffer size to every connection it accepts, and a
    set size is fixed: without it the kernel grows a connection's send buffer up to its
    ``tcp_wmem`` maximum (4 MiB), which a client that reads nothing fills only after thousands of
    tokens, so no write would ever wait and ``--stall-timeout`` (server/stall.py) never see it."""
    sock = config.bind_socket()
    if send_buffer > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    return sock


async def _serve(
    server: SupervisedServer, engine: AsyncEngine, config: ServerConfig, sock: socket.socket
) -> int:
    tasks = [
        asyncio.create_task(_watch_loading(server, engine, config)),
        asyncio.create_task(supervise(server, engine, server.lifecycle, config)),
    ]
    if config.log_stats_interval > 0:
        tasks.append(asyncio.create_task(log_stats_every(engine, config.log_stats_interval)))
    try:
        await server.serve(sockets=[sock])
    finally:
        for task in tasks:
            task.cancel()
    return 1 if engine.load_error is not None or engine.failure is not None else 0


async def _watch_loading(server: uvicorn.Server, engine: AsyncEngine, config: ServerConfig) -> None:
    while not engine.ready:
        if engine.load_error is not None:
            log.error("the model failed to load: %s", engine.load_error)
            server.should_exit = True
            return
        await asyncio.sleep(LOAD_POLL_S)
    if Knobs.from_env().gc_freeze:
        freeze_loaded_objects()
    log.info("ready: serving %s on http://%s:%d", engine.model_name, config.host, config.port)
