"""kvpark bench --scenario pressure, the numbers: the preemption counters read from /metrics, the
summary math of a level, the fit check, the decode rate and A/B/A ratio, the goals met and not
met, and the JSON + PNG written. Built from synthetic request results, no server;
test_bench_pressure_runs.py runs the scenario.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvpark.bench import RunResult
from kvpark.bench.client import RequestResult
from kvpark.bench.compare import payload
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
