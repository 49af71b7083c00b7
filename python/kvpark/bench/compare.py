"""Several servers, one run: the same scenario against each in turn, then ratios against a baseline.

Servers run one after another (never at once: they would share the CPU), each with the same seeded
workload. A ratio is ``other / baseline``: above 1 means the other is faster for throughput and
decode rates, and slower for latencies (TTFT, ITL).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import platform
import time
from collections.abc import Callable
from typing import Any

from kvpark.bench.client import Target, first_model
from kvpark.bench.options import BenchOptions
from kvpark.bench.report import RunResult, format_table
from kvpark.bench.scenarios import SCENARIOS

FORMAT_VERSION = 1
RATIO_FIELDS = (
    "aggregate_tok_s",
    "decode_tok_s_p50",
    "ttft_p50_s",
    "ttft_p95_s",
    "itl_p50_s",
    "itl_p95_s",
)


def _ratio(num: float, den: float) -> float | None:
    if not (math.isfinite(num) and math.isfinite(den)) or den == 0:
        return None
    return num / den


def compare(runs: list[RunResult], baseline: str) -> dict[str, Any]:
    """Ratios of every other run to the run labelled ``baseline``, per concurrency level."""
    base = next((run for run in runs if run.label == baseline), None)
    if base is None:
        raise ValueError(f"no run is labelled {baseline!r}")
    out: dict[str, Any] = {"baseline": baseline, "ratios": {}}
    for run in runs:
        if run is base:
            continue
        levels: dict[str, dict[str, float | None]] = {}
        for lv in run.levels:
            other = base.level(lv.concurrency)
            if other is None:
                continue
            levels[str(lv.concurrency)] = {
                name: _ratio(getattr(lv, name), getattr(other, name)) for name in RATIO_FIELDS
            }
        out["ratios"][run.label] = {
            "single_stream_decode_tok_s": _ratio(
                run.single_stream_decode_tok_s, base.single_stream_decode_tok_s
            ),
            "levels": levels,
        }
    return out


def format_comparison(comparison: dict[str, Any]) -> str:
    """Ratio lines: single-stream decode, then aggregate tok/s and TTFT p50 per level."""

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    lines = [f"ratios against {comparison['baseline']} (other / baseline):"]
    for label, ratios in comparison["ratios"].items():
        single = show(ratios["single_stream_decode_tok_s"])
        lines.append(f"  {label}: single-stream decode {single}")
        for conc, fields in ratios["levels"].items():
            lines.append(
                f"    {conc:>3} chats: aggregate {show(fields['aggregate_tok_s'])}, "
                f"TTFT p50 {show(fields['ttft_p50_s'])}, ITL p50 {show(fields['itl_p50_s'])}"
            )
    return "\n".join(lines)


async def resolve_model(target: Target) -> Target:
    """``target`` with its model name filled in from ``GET /v1/models`` when none was given."""
    if target.model is not None:
        return target
    return dataclasses.replace(target, model=await first_model(target))


async def run_targets(
    targets: list[Target],
    scenario: str,
    options: BenchOptions,
    log: Callable[[str], None] = print,
) -> list[RunResult]:
    """Run ``scenario`` against each target in turn; print each server's table as it finishes."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    runs = []
    for target in targets:
        resolved = await resolve_model(target)
        log(f"[{resolved.label}] {scenario} against {resolved.url} (model {resolved.model})")
        run = await SCENARIOS[scenario](resolved, options)
        log(format_table([run]))
        runs.append(run)
    return runs


def run(targets: list[Target], scenario: str, options: BenchOptions) -> list[RunResult]:
    """Run ``scenario`` against every target, one after another (the library entry point)."""
    return asyncio.run(run_targets(targets, scenario, options))


def payload(
    runs: list[RunResult], baseline: str | None = None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON document of a run: every server's result and, with two or more, the comparison."""
    doc: dict[str, Any] = {
        "kvpark_bench": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "system": platform.system(),
        },
        "runs": [run.to_json() for run in runs],
    }
    if len(runs) > 1:
        doc["comparison"] = compare(runs, baseline or runs[0].label)
    if extra:
        doc.update(extra)
    return doc
