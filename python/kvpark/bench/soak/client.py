"""Sending one soak request and reading its answer the way its client would: at once, slowly
(1 KiB at a time with pauses, so the server's buffers fill), or until a drawn event and then
hanging up. What came back is an :class:`Outcome`; nothing here raises for a failed request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpark.bench.soak.plan import DISCONNECT, SoakRequest

SLOW_READ_BYTES = 1024
SLOW_PAUSE_S = 0.2


@dataclass
class Outcome:
    """One request's answer: per choice its text and finish reason, the error object (a plain
    error body, or one sent in-stream), the SSE comments, and whether we hung up."""

    index: int
    status: int = 0
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    completion_tokens: int | None = None
    error: dict[str, Any] | None = None
    notices: list[str] = field(default_factory=list)
    transport: str | None = None  # the connection failed: what httpx said
    hung_up: bool = False
    done: bool = False  # a stream's [DONE] (or a plain body) arrived
    elapsed_s: float = 0.0

    def answer(self) -> dict[str, Any]:
        """What two runs of one request must agree on: each choice's text and finish reason,
        and the completion tokens."""
        choices = {str(i): [self.texts.get(i, ""), self.finish.get(i)] for i in sorted(self.texts)}
        return {"choices": choices, "completion_tokens": self.completion_tokens}


def _take_choices(outcome: Outcome, choices: list[dict[str, Any]], streamed: bool) -> None:
    for choice in choices:
        index = int(choice.get("index", 0))
        if streamed:
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        else:
            message = choice.get("message")
            piece = message.get("content") if isinstance(message, dict) else choice.get("text")
        outcome.texts[index] = outcome.texts.get(index, "") + (piece or "")
        if choice.get("finish_reason") is not None or index not in outcome.finish:
            outcome.finish[index] = choice.get("finish_reason")


def _take_chunk(outcome: Outcome, chunk: dict[str, Any]) -> None:
    if isinstance(chunk.get("error"), dict):
        outcome.error = chunk["error"]
        return
    _take_choices(outcome, chunk.get("choices") or [], streamed=True)
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        outcome.completion_tokens = usage.get("completion_tokens")


async def _lines(response: httpx.Response, slow: bool) -> AsyncIterator[str]:
    if not slow:
        async for line in response.aiter_lines():
            yield line
        return
    pending = ""
    async for piece in response.aiter_raw(SLOW_READ_BYTES):
        pending += piece.decode("utf-8", errors="replace")
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.rstrip("\r")
        await asyncio.sleep(SLOW_PAUSE_S)
    if pending:
        yield pending


async def _stream(client: httpx.AsyncClient, url: str, request: SoakRequest, out: Outcome) -> None:
    headers = {"content-type": "application/json"}
    async with client.stream("POST", url, content=request.content(), headers=headers) as response:
        out.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            _take_error(out, response.content)
            return
        events = 0
        async for line in _lines(response, request.slow):
            if line.startswith(":"):
                if line.strip(": "):
                    out.notices.append(line[1:].strip())
            elif line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: "):
                _take_chunk(out, json.loads(line.removeprefix("data: ")))
                events += 1
                if request.kind == DISCONNECT and events >= request.cut_after:
                    out.hung_up = True
                    return  # leaving the block closes the connection mid-stream


def _take_error(out: Outcome, content: bytes) -> None:
    try:
        body = json.loads(content)
    except json.JSONDecodeError:
        out.error = {"message": f"not JSON: {content[:200]!r}"}
        return
    error = body.get("error") if isinstance(body, dict) else None
    out.error = error if isinstance(error, dict) else {"message": f"no error object: {body!r}"}


async def send(client: httpx.AsyncClient, base_url: str, request: SoakRequest) -> Outcome:
    """Send ``request`` and read its answer as its client would."""
    out = Outcome(request.index)
    url = base_url.rstrip("/") + request.path
    start = time.perf_counter()
    try:
        if request.stream:
            await _stream(client, url, request, out)
        else:
            headers = {"content-type": "application/json"}
            response = await client.post(url, content=request.content(), headers=headers)
            out.status = response.status_code
            if response.status_code == 200:
                body = response.json()
                _take_choices(out, body.get("choices") or [], streamed=False)
                out.completion_tokens = (body.get("usage") or {}).get("completion_tokens")
                out.done = True
            else:
                _take_error(out, response.content)
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        out.transport = f"{type(exc).__name__}: {exc}"
    out.elapsed_s = time.perf_counter() - start
    return out
