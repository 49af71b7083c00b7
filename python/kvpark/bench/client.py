"""Streaming client for any OpenAI-compatible server: one request's timings, and a bounded level.

Per request it records the time of the first token, the time of every later token chunk (so
every inter-token gap), the tokens out (``usage.completion_tokens`` when the server sends it, else
the count of content chunks), the server's ``timings`` object if any, and every SSE comment line
with its time (``: preempted``, ``: resumed`` ...; plain ``:`` pings are counted, not kept), and
kvpark's final ``preempt`` record (``{"parks", "recomputes"}``) when the server sends one. A
failed request keeps its error and never raises: one bad request must not end a benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpark.bench.sse_http import ConnectError, HttpStatusError, ProtocolError, post_lines
from kvpark.bench.workload import RequestSpec


@dataclass(frozen=True)
class Target:
    """A server under test. ``model`` None: ask ``GET /v1/models`` and use its first id."""

    url: str
    label: str
    model: str | None = None
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class RequestBody:
    """What every request of a run sends besides its prompt and length."""

    model: str
    endpoint: str = "chat"  # chat | completions
    temperature: float = 0.0
    ignore_eos: bool = True  # a kvpark extension; servers that do not know it ignore it
    extra: dict[str, Any] = field(default_factory=dict)  # merged last: e.g. a peer's logit_bias

    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def render(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "temperature": self.temperature,
            "seed": spec.index,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if spec.messages is not None:
            body["messages"] = list(spec.messages)
        elif self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra)
        return body


@dataclass
class RequestResult:
    """One request's record. Times are seconds since its level started (``time.perf_counter``)."""

    index: int
    sent_s: float = 0.0
    token_s: list[float] = field(default_factory=list)  # arrival time of each content chunk
    done_s: float = 0.0
    chunks: int = 0
    usage_tokens: int | None = None  # usage.completion_tokens, when the server reports it
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    timings: dict[str, Any] | None = None
    preempt: dict[str, Any] | None = None  # kvpark's {"parks", "recomputes"} from the last chunk
    notices: list[tuple[float, str]] = field(default_factory=list)  # (time, comment text)
    pings: int = 0
    error: str | None = None
    text: list[str] = field(default_factory=list)  # the content chunks, in order
    # prompt tokens the server's prefix cache supplied: usage.prompt_tokens_details.cached_tokens
    # (OpenAI's field) or timings.cache_n (llama.cpp's)
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.chunks > 0

    @property
    def tokens_out(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.sent_s if self.token_s else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_s[:-1], self.token_s[1:], strict=True)]

    @property
    def decode_tok_s(self) -> float | None:
        """(tokens − 1) / (last token time − first token time); None below two chunks."""
        if len(self.token_s) < 2 or self.token_s[-1] <= self.token_s[0]:
            return None
        return (self.tokens_out - 1) / (self.token_s[-1] - self.token_s[0])


def _chunk_text(chunk: dict[str, Any]) -> str | None:
    """The generated text a chunk carries, or None when it carries none (role, usage, final)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        content = delta.get("content")
        return content if isinstance(content, str) else None
    text = choice.get("text")
    return text if isinstance(text, str) else None


def _absorb(result: RequestResult, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:
        result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
        return
    text = _chunk_text(chunk)
    finish = next(
        (c["finish_reason"] for c in chunk.get("choices") or [] if c.get("finish_reason")), None
    )
    # An empty text still marks a token (a partial UTF-8 sequence), but not before the first token
    # nor in the closing chunk that only carries the finish reason.
    if text or (text == "" and result.chunks and finish is None):
        result.chunks += 1
        result.token_s.append(now)
        result.text.append(text or "")
    if finish:
        result.finish_reason = str(finish)
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        result.usage_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            result.cached_tokens = details["cached_tokens"]
    if isinstance(chunk.get("timings"), dict):
        result.timings = chunk["timings"]
        if result.cached_tokens is None and isinstance(chunk["timings"].get("cache_n"), int):
            result.cached_tokens = chunk["timings"]["cache_n"]
    if isinstance(chunk.get("preempt"), dict):
        result.preempt = chunk["preempt"]


async def stream_one(
    target: Target,
    body: RequestBody,
    spec: RequestSpec,
    t0: float,
    result: RequestResult | None = None,
) -> RequestResult:
    """Send one streaming request and record it into ``result`` (a new one by default), over
    its own connection (``sse_http``: a client that costs the shared cores little per chunk).

    Errors land in ``result.error``; a caller that cancels it (a timeout) keeps what was recorded.
    """
    result = result if result is not None else RequestResult(spec.index)
    result.sent_s = time.perf_counter() - t0
    url = target.url.rstrip("/") + body.path()
    try:
        async with contextlib.aclosing(
            post_lines(url, body.render(spec), target.headers())
        ) as lines:
            async for line in lines:
                now = time.perf_counter() - t0
                if line.startswith(":"):
                    comment = line[1:].strip()
                    if comment:
                        result.notices.append((now, comment))
                    else:
                        result.pings += 1
                elif line.startswith("data:"):
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    _absorb(result, json.loads(data), now)
    except HttpStatusError as exc:
        result.error = f"HTTP {exc.status}: {exc.body[:300]}"
    except (ConnectError, ProtocolError, OSError, EOFError, ValueError) as exc:
        # EOFError: the connection closed mid-chunk; ValueError: a data line not JSON
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        result.done_s = time.perf_counter() - t0
    if result.error is None and result.chunks == 0:
        result.error = "no tokens streamed"
    return result


async def run_level(
    target: Target,
    body: RequestBody,
    specs: list[RequestSpec],
    concurrency: int,
    timeout_s: float,
) -> tuple[float, list[RequestResult]]:
    """Run ``specs`` with at most ``concurrency`` in flight; return (wall seconds, results).

    Each request waits for its arrival offset, then for a free place; each is cut off after
    ``timeout_s`` (recorded as an error), so the level ends within about
    ``len(specs) / concurrency × timeout_s`` plus the last arrival offset.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    places = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def one(spec: RequestSpec) -> RequestResult:
        await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - t0)))
        result = RequestResult(spec.index)
        async with places:
            try:
                await asyncio.wait_for(stream_one(target, body, spec, t0, result), timeout_s)
            except asyncio.TimeoutError:
                result.error = f"timed out after {timeout_s:g} s"
        return result

    results = await asyncio.gather(*(one(spec) for spec in specs))
    wall_s = time.perf_counter() - t0
    return wall_s, list(results)


async def first_model(target: Target, timeout_s: float = 10.0) -> str:
    """The first model id of ``GET /v1/models`` (what ``--model`` defaults to)."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        response = await client.get(target.url.rstrip("/") + "/v1/models", headers=target.headers())
        response.raise_for_status()
        models = response.json().get("data") or []
        if not models:
            raise RuntimeError(f"{target.url} lists no models")
        return str(models[0]["id"])
