"""The HTTP server: OpenAI-compatible routes over an ``AsyncEngine`` (see docs/server.md)."""

from __future__ import annotations

from kvpark.server.app import build_app
from kvpark.server.run import serve

__all__ = ["build_app", "serve"]
