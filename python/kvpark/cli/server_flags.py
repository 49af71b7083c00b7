"""The flags of ``kvpark serve``'s HTTP server (address, auth, logging, limits) and the
``ServerConfig`` they build."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpark.cli.values import Repeatable, int_at_least, one_of, port, seconds
from kvpark.config.layers import HTTP_STACKS, ServerConfig

DEFAULT_LOG_STATS_INTERVAL_S = 10.0
DEFAULT_ENGINE_TIMEOUT_S = 60.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_STALL_TIMEOUT_S = 30.0
DEFAULT_STREAM_BUFFER = 1024
DEFAULT_SEND_BUFFER = 65536
DEFAULT_RESPONSE_STORE = 1024
DEFAULT_RESPONSE_STORE_MIB = 256
DEFAULT_RESPONSE_STORE_TTL_S = 3600.0


def add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=8000, help="port to listen on")
    p.add_argument(
        "--api-key",
        action=Repeatable,
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but "
        "/health; repeat it for several keys, any of which lets a request in",
    )
    p.add_argument(
        "--api-key-file", metavar="PATH", help="read the API keys from this file, one per line"
    )
    p.add_argument(
        "--cache-salt-by-key",
        action="store_true",
        help="fold each request's API key into its cache salt: requests made with different "
        "keys never share cached prefix pages (needs --api-key or --api-key-file)",
    )
    p.add_argument(
        "--sse-ping-interval",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="':' ping on idle streams (0: off); parked streams get a keepalive "
        "every min(this, 2 s)",
    )
    p.add_argument("--log-format", type=one_of("text", "json"), default="text", help="text or json")
    p.add_argument(
        "--http-stack",
        type=one_of(*HTTP_STACKS),
        default="auto",
        help="the event loop and HTTP parser: uvloop + httptools (C; auto where installed) or "
        "asyncio + h11 (pure Python)",
    )
    p.add_argument(
        "--log-health",
        action="store_true",
        help="access-log /health polls and /metrics scrapes too (other requests always are)",
    )
    p.add_argument(
        "--log-stats-interval",
        type=seconds,
        default=DEFAULT_LOG_STATS_INTERVAL_S,
        metavar="SECONDS",
        help="while requests run, log throughput, queue, KV usage and preemptions every SECONDS "
        "(0: off)",
    )
    p.add_argument(
        "--served-model-name",
        help="model name announced by /v1/models; requests may also name the model's file name "
        "or 'default' (default: the model's file name)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int_at_least(1),
        default=8 * 1024 * 1024,
        help="larger request bodies get 413",
    )
    p.add_argument(
        "--engine-timeout",
        type=seconds,
        default=DEFAULT_ENGINE_TIMEOUT_S,
        metavar="SECONDS",
        help="an engine thread that spends this long in one step (or one turn of its loop) is "
        "wedged: /health answers 503, open requests end with an error, the process exits 1 "
        "(0: never)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, how long running requests may finish before they end with "
        "an error event; new requests get 503 meanwhile (a second signal: at once)",
    )
    p.add_argument(
        "--stall-timeout",
        type=seconds,
        default=DEFAULT_STALL_TIMEOUT_S,
        metavar="SECONDS",
        help="a stream whose client has read nothing for SECONDS (one write has waited that long "
        "on a full socket) is aborted: its cells and parked bytes come back, the connection "
        "closes (0: never)",
    )
    p.add_argument(
        "--stream-buffer",
        type=int_at_least(0),
        default=DEFAULT_STREAM_BUFFER,
        metavar="EVENTS",
        help="engine events (about one per token per prompt) a stream may hold unsent for a "
        "client that is not reading; one more aborts it at once (0: no bound)",
    )
    p.add_argument(
        "--reattach-seconds",
        type=seconds,
        default=0.0,
        metavar="SECONDS",
        help="a stream whose client disconnects goes on generating for up to SECONDS more (its "
        "cells and slot held while it runs): every event gets an SSE id, the stream id comes in "
        "the x-kvpark-stream-id header and the first event, and GET /v1/streams/{id} with "
        "Last-Event-ID writes what the client missed, then the rest; unclaimed, it is aborted. "
        "Its events stay in memory (a few hundred bytes each) until read to the end, at most "
        "--stream-buffer of them unwritten (0: off, a disconnect aborts the stream at once)",
    )
    p.add_argument(
        "--response-store",
        type=int_at_least(0),
        default=DEFAULT_RESPONSE_STORE,
        metavar="N",
        help="/v1/responses kept in memory (store: true, the default, and every background: "
        "true response) for GET /v1/responses/{id}, previous_response_id and cancel: at most N, "
        "the oldest finished forgotten first (0: none is kept; store, background and "
        "previous_response_id are refused)",
    )
    p.add_argument(
        "--response-store-mib",
        type=int_at_least(1),
        default=DEFAULT_RESPONSE_STORE_MIB,
        metavar="MIB",
        help="the stored responses' bytes (objects, conversations, background events) at most; "
        "past it the oldest finished are forgotten first",
    )
    p.add_argument(
        "--response-store-ttl",
        type=seconds,
        default=DEFAULT_RESPONSE_STORE_TTL_S,
        metavar="SECONDS",
        help="a stored response is forgotten SECONDS after it finished (0: only the bounds "
        "push it out)",
    )
    p.add_argument(
        "--send-buffer",
        type=int_at_least(0),
        default=DEFAULT_SEND_BUFFER,
        metavar="BYTES",
        help="each connection's socket send buffer (SO_SNDBUF; Linux doubles it): what a client "
        "that reads nothing can leave unread before writes wait (0: the kernel's own, growing "
        "to its tcp_wmem maximum)",
    )

    p.add_argument(
        "--no-web",
        action="store_true",
        help="serve neither the chat page at / nor the pool view at /pool (and their files "
        "under /web/): / then answers 404, and with an API key 401, like any unknown route",
    )


def server_config(args: argparse.Namespace, p: argparse.ArgumentParser) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_keys=_api_keys(args, p),
        cache_salt_by_key=args.cache_salt_by_key,
        sse_ping_interval=args.sse_ping_interval,
        log_format=args.log_format,
        log_health=args.log_health,
        http_stack=args.http_stack,
        log_stats_interval=args.log_stats_interval,
        max_body_bytes=args.max_body_bytes,
        served_model_name=args.served_model_name,
        engine_timeout=args.engine_timeout,
        shutdown_timeout=args.shutdown_timeout,
        stall_timeout=args.stall_timeout,
        stream_buffer=args.stream_buffer,
        reattach_seconds=args.reattach_seconds,
        response_store=args.response_store,
        response_store_mib=args.response_store_mib,
        response_store_ttl=args.response_store_ttl,
        send_buffer=args.send_buffer,
        web=not args.no_web,
    )


def _api_keys(args: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[str, ...]:
    """The keys of --api-key (repeated) or of --api-key-file (one per line, blank lines
    skipped); exit 2 for an empty key, both flags, or --cache-salt-by-key without a key."""
    keys: list[str] = list(args.api_key)
    if args.api_key_file is not None:
        if keys:
            p.error("give --api-key or --api-key-file, not both")
        try:
            text = Path(args.api_key_file).read_text()
        except OSError as exc:
            p.error(f"--api-key-file {args.api_key_file}: {exc.strerror}")
        keys = [line.strip() for line in text.splitlines() if line.strip()]
        if not keys:
            p.error(f"--api-key-file {args.api_key_file} is empty")
    if any(not key for key in keys):
        p.error("--api-key is empty")
    if args.cache_salt_by_key and not keys:
        p.error("--cache-salt-by-key needs --api-key or --api-key-file")
    return tuple(dict.fromkeys(keys))
