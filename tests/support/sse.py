"""The lines and data objects of a streamed (SSE) response."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import httpx


def sse_lines(response: httpx.Response) -> list[str]:
    """The non-empty lines of an SSE body, in order (data lines and comments)."""
    return [line for line in response.iter_lines() if line]


def sse_data(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON objects of the data lines, [DONE] excluded."""
    objects = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            objects.append(json.loads(line[len("data: ") :]))
    return objects
