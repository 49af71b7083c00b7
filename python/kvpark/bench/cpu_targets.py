"""The issue's targets for kvpark against the baseline peer, and the table for docs/benchmarks.md.

A ratio is ``kvpark / baseline`` (the comparison's ``compare``): above 1 is faster for
throughput; for memory, above 1 is more. Each target is judged MET / NOT MET, or "not measured"
where a figure is missing (a level or a server that did not run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpark.bench.report import RunResult

OURS = "kvpark"


@dataclass(frozen=True)
class Goal:
    """``ours / baseline`` of one figure against a target and a stretch target; ``at_most`` for
    figures where less is better (memory)."""

    name: str
    target: float
    stretch: float | None = None
    at_most: bool = False

    def met(self, ratio: float | None, bound: float) -> bool | None:
        if ratio is None or not math.isfinite(ratio):
            return None
        return ratio <= bound if self.at_most else ratio >= bound


GOALS = (
    Goal("single-stream decode tok/s", 1.0, 1.3),
    Goal("aggregate tok/s at 8 chats", 2.0, 3.0),
    Goal("peak resident memory", 2.0, at_most=True),
)


def ratio(ours: float | None, base: float | None) -> float | None:
    if ours is None or base is None or not (math.isfinite(ours) and math.isfinite(base)):
        return None
    return ours / base if base > 0 else None


def judge(comparison: dict[str, Any], memory: dict[str, float]) -> list[dict[str, Any]]:
    """Each goal of ``GOALS`` for ``OURS`` against the comparison's baseline: ratio, met, stretch
    met (None where a figure is missing, e.g. a server that was not measured)."""
    ours = comparison["ratios"].get(OURS, {})
    ratios = (
        ours.get("single_stream_decode_tok_s"),
        ours.get("levels", {}).get("8", {}).get("aggregate_tok_s"),
        ratio(memory.get(OURS), memory.get(comparison["baseline"])),
    )
    return [
        {
            "goal": goal.name,
            "ratio": value,
            "target": goal.target,
            "met": goal.met(value, goal.target),
            "stretch": goal.stretch,
            "stretch_met": goal.met(value, goal.stretch) if goal.stretch else None,
        }
        for goal, value in zip(GOALS, ratios, strict=True)
    ]


def format_goals(verdicts: list[dict[str, Any]], against: str) -> str:
    def word(met: bool | None) -> str:
        return "not measured" if met is None else ("MET" if met else "NOT MET")

    lines = [f"targets ({OURS} / {against}):"]
    for v, goal in zip(verdicts, GOALS, strict=True):
        shown = "-" if v["ratio"] is None else f"{v['ratio']:.2f}x"
        sign = "<=" if goal.at_most else ">="
        line = f"  {v['goal']}: {shown} (target {sign} {v['target']:g}x): {word(v['met'])}"
        if goal.stretch:
            line += f"; stretch {goal.stretch:g}x: {word(v['stretch_met'])}"
        lines.append(line)
    return "\n".join(lines)


def _num(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f}".replace(",", " ") + suffix


def markdown_rows(
    runs: list[RunResult], memory: dict[str, float], comparison: dict[str, Any] | None
) -> list[str]:
    """docs/benchmarks.md's table: one row per server, then one of ratios per other server."""
    levels = [lv.concurrency for lv in runs[0].levels] if runs else []
    at = " / ".join(str(c) for c in levels)
    rows = [
        f"| server | single-stream decode tok/s | aggregate tok/s at {at} chats "
        f"| TTFT p50 (ms) at {at} | peak RSS (MiB) |",
        "|---|---|---|---|---|",
    ]
    for run_ in runs:
        agg = [run_.level(c) for c in levels]
        rows.append(
            f"| {run_.label} | {_num(run_.single_stream_decode_tok_s)} "
            f"| {' / '.join(_num(lv.aggregate_tok_s if lv else None) for lv in agg)} "
            f"| {' / '.join(_num(lv.ttft_p50_s * 1000 if lv else None, 0) for lv in agg)} "
            f"| {_num(memory.get(run_.label), 0)} |"
        )
    for label, r in (comparison or {}).get("ratios", {}).items():
        per = [r["levels"].get(str(c), {}) for c in levels]
        base = comparison["baseline"]  # type: ignore[index]
        rows.append(
            f"| {label} / {base} | {_num(r['single_stream_decode_tok_s'], 2, '×')} "
            f"| {' / '.join(_num(f.get('aggregate_tok_s'), 2, '×') for f in per)} "
            f"| {' / '.join(_num(f.get('ttft_p50_s'), 2, '×') for f in per)} "
            f"| {_num(ratio(memory.get(label), memory.get(base)), 2, '×')} |"
        )
    return rows
