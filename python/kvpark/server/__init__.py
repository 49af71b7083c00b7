"""The HTTP server: OpenAI-compatible routes, SSE, auth and metrics over an ``AsyncEngine``
(docs/server.md). Imports engine, sampling, tokenizer and config; never the pool or tensors."""

from __future__ import annotations

from kvpark.server.app import build_app
from kvpark.server.run import serve

__all__ = ["build_app", "serve"]
