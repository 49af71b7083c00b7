"""The headline benchmark's goals, its A/B/A no-pressure check and its plot (``pressure.py``
summarises the levels these read; ``kvpark bench --scenario pressure`` runs them)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvpark.bench.pressure import (
    BASELINE,
    DEFAULT,
    GOAL_DECODE_RATIO,
    GOAL_WALL_RATIO,
    RECOMPUTE_ONLY,
    PressureLevel,
    finite,
    pressure_levels,
)
from kvpark.bench.report import RunResult, pyplot


def decode_rate(records: list[dict[str, Any]]) -> float:
    """Decode tok/s of a level from its request records: Σ(tokens − 1) over the completed requests,
    divided by the time from the earliest first token to the latest last token; NaN if none."""
    done = [r for r in records if r.get("ok") and len(r.get("token_s") or []) >= 2]
    if not done:
        return math.nan
    start = min(r["token_s"][0] for r in done)
    end = max(r["token_s"][-1] for r in done)
    if end <= start:
        return math.nan
    return float(sum(int(r["tokens_out"]) - 1 for r in done) / (end - start))


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if len(finite) == len(values) and finite else math.nan


def _ratio(num: float, den: float) -> float:
    return num / den if math.isfinite(num) and math.isfinite(den) and den > 0 else math.nan


def aba_summary(a1: RunResult, b: RunResult, a2: RunResult, chats: int) -> dict[str, Any]:
    """Preemption on (A, twice) against off (B) with no pressure: single-stream decode tok/s (the
    median per-request rate at concurrency 1) and ``chats``-chat decode tok/s (``decode_rate``).
    ``ratio`` = mean of the two A / B (1.0: no cost); ``a_spread`` = |A1 − A2| / mean(A), the
    run-to-run noise the ratio should be read against."""
    out: dict[str, Any] = {"chats": chats, "labels": [a1.label, b.label, a2.label]}
    for key, value_of in (
        ("single_stream", lambda run: run.single_stream_decode_tok_s),
        (f"{chats}_chats", lambda run: decode_rate(run.requests.get(chats, []))),
    ):
        values = [value_of(run) for run in (a1, b, a2)]
        a_mean = _mean([values[0], values[2]])
        out[key] = {
            "decode_tok_s": [finite(v) for v in values],
            "a_mean": finite(a_mean),
            "ratio": finite(_ratio(a_mean, values[1])),
            "a_spread": finite(_ratio(abs(values[0] - values[2]), a_mean)),
        }
    return out


# --- goals ------------------------------------------------------------------------------------


def evaluate_goals(runs: list[RunResult], aba: dict[str, Any] | None = None) -> dict[str, Any]:
    """The issue's goals, each with ``met`` (None when the runs needed are missing):

    - ``all_complete_with_parking``: every request completes on ``recompute-only`` and ``default``;
    - ``baseline_fails_some``: ``no-preempt`` ends some request with the context error (the
      workload really overflows the pool);
    - ``default_wall_vs_recompute``: default's wall time <= 0.8x recompute-only's at every level;
    - ``no_pressure_cost``: with no pressure, preemption on keeps >= 98 % of the decode tok/s of
      ``--no-preempt``, single-stream and multi-chat (from ``aba_summary``).
    """
    by_label = {run.label: {lv.chats: lv for lv in pressure_levels(run)} for run in runs}
    goals: dict[str, Any] = {}

    parking = [by_label[m] for m in (RECOMPUTE_ONLY, DEFAULT) if m in by_label]
    goals["all_complete_with_parking"] = {
        "met": None
        if not parking
        else all(lv.completed == lv.requests for levels in parking for lv in levels.values()),
        "completed": {
            m: {str(c): f"{lv.completed}/{lv.requests}" for c, lv in by_label[m].items()}
            for m in (RECOMPUTE_ONLY, DEFAULT)
            if m in by_label
        },
    }
    base = by_label.get(BASELINE)
    goals["baseline_fails_some"] = {
        "met": None if base is None else any(lv.context_errors > 0 for lv in base.values()),
        "context_errors": {str(c): lv.context_errors for c, lv in (base or {}).items()},
    }
    ratios: dict[str, float | None] = {}
    if RECOMPUTE_ONLY in by_label and DEFAULT in by_label:
        for chats, lv in by_label[DEFAULT].items():
            other = by_label[RECOMPUTE_ONLY].get(chats)
            if other is not None:
                ratios[str(chats)] = finite(_ratio(lv.wall_s, other.wall_s))
    goals["default_wall_vs_recompute"] = {
        "target": GOAL_WALL_RATIO,
        "ratios": ratios,
        "met": None
        if not ratios
        else all(r is not None and r <= GOAL_WALL_RATIO for r in ratios.values()),
    }
    cost: dict[str, Any] = {"target": GOAL_DECODE_RATIO, "met": None}
    if aba is not None:
        parts = {k: v for k, v in aba.items() if isinstance(v, dict) and "ratio" in v}
        cost["ratios"] = {k: v["ratio"] for k, v in parts.items()}
        cost["a_spread"] = {k: v["a_spread"] for k, v in parts.items()}
        cost["met"] = bool(parts) and all(
            v["ratio"] is not None and v["ratio"] >= GOAL_DECODE_RATIO for v in parts.values()
        )
        # The two A runs differ by more than the cost being measured: the verdict is noise.
        cost["noisy"] = any(
            v["a_spread"] is None or v["a_spread"] > 1 - GOAL_DECODE_RATIO for v in parts.values()
        )
    goals["no_pressure_cost"] = cost
    return goals


def format_goals(goals: dict[str, Any]) -> str:
    def verdict(met: bool | None) -> str:
        return "n/a" if met is None else ("MET" if met else "NOT MET")

    def ratios(values: dict[str, float | None]) -> str:
        return ", ".join(f"{k}: {'-' if v is None else f'{v:.3f}'}" for k, v in values.items())

    g = goals
    lines = ["goals:"]
    done = g["all_complete_with_parking"]
    lines.append(
        f"  every request completes with parking on: {verdict(done['met'])} {done['completed']}"
    )
    base = g["baseline_fails_some"]
    lines.append(
        f"  --no-preempt fails some (context errors): {verdict(base['met'])} "
        f"{base['context_errors']}"
    )
    wall = g["default_wall_vs_recompute"]
    lines.append(
        f"  default wall <= {wall['target']}x recompute-only's: {verdict(wall['met'])} "
        f"({ratios(wall['ratios'])})"
    )
    cost = g["no_pressure_cost"]
    text = f"  no pressure, preempt on / off decode >= {cost['target']}: {verdict(cost['met'])}"
    if "ratios" in cost:
        text += f" ({ratios(cost['ratios'])}; A-A spread {ratios(cost['a_spread'])})"
    if cost.get("noisy"):
        text += (
            "\n    (the two A runs differ by more than 2 %: the verdict is noise; measure again)"
        )
    lines.append(text)
    return "\n".join(lines)


# --- the plot ---------------------------------------------------------------------------------


def write_pressure_plot(
    path: Path,
    runs: list[RunResult],
    aba: dict[str, Any] | None = None,
    title: str = "kvpark bench pressure",
) -> Path | None:
    """A 2×3 PNG of bars, one group per level (N chats), one bar per server: completed / context
    errors / other errors, wall time, aggregate tok/s, p95 gap, parks by mode (swap / recompute),
    and the A/B/A no-pressure decode tok/s when given; None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None

    levels = {run.label: {lv.chats: lv for lv in pressure_levels(run)} for run in runs}
    chats = sorted({c for by_chats in levels.values() for c in by_chats})
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), constrained_layout=True)
    (outcome, wall, thr), (gap, parks, cost) = axes
    width = 0.8 / max(1, len(runs))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(chats))]
        rows = [levels[run.label].get(c) for c in chats]

        def values(name: str, rows: list[PressureLevel | None] = rows) -> list[float]:
            out = []
            for lv in rows:
                value = getattr(lv, name) if lv is not None else None
                out.append(math.nan if value is None else float(value))
            return out

        done, ctx, other = values("completed"), values("context_errors"), values("other_errors")
        outcome.bar(xs, done, width, color=color, label=run.label)
        outcome.bar(xs, ctx, width, bottom=done, color=color, hatch="xx", alpha=0.45)
        bottom = [a + b for a, b in zip(done, ctx, strict=True)]
        if any(v > 0 for v in other):
            outcome.bar(xs, other, width, bottom=bottom, color="grey", alpha=0.6)
        wall.bar(xs, values("wall_s"), width, color=color, label=run.label)
        thr.bar(xs, values("aggregate_tok_s"), width, color=color, label=run.label)
        gap.bar(xs, [v * 1000 for v in values("itl_p95_s")], width, color=color, label=run.label)
        swap = [0.0 if math.isnan(v) else v for v in values("parks_swap")]
        recompute = [0.0 if math.isnan(v) else v for v in values("parks_recompute")]
        parks.bar(xs, swap, width, color=color, label=run.label)
        parks.bar(xs, recompute, width, bottom=swap, color=color, hatch="//", alpha=0.45)

    for ax, ylabel in (
        (outcome, "requests (solid: completed, hatched: context errors, grey: other)"),
        (wall, "wall time (s)"),
        (thr, "aggregate tok/s (completed requests)"),
        (gap, "p95 gap between tokens (ms)"),
        (parks, "parks (solid: swap, hatched: recompute)"),
    ):
        ax.set_xticks(range(len(chats)), [f"{c} chats" for c in chats])
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    parks.yaxis.get_major_locator().set_params(integer=True)

    if aba is not None:
        keys = [k for k, v in aba.items() if isinstance(v, dict) and "decode_tok_s" in v]
        labels = list(aba.get("labels") or ["A", "B", "A"])
        for i, label in enumerate(labels):
            xs = [j + (i - 1) * 0.27 for j in range(len(keys))]
            ys = [aba[k]["decode_tok_s"][i] for k in keys]
            cost.bar(xs, [math.nan if y is None else y for y in ys], 0.27,
                     color=colors[(i % 2) + 3], label=label)  # fmt: skip
        names = []
        for k in keys:
            ratio = aba[k]["ratio"]
            names.append(f"{k.replace('_', ' ')}\nA/B {'-' if ratio is None else f'{ratio:.3f}'}")
        cost.set_xticks(range(len(keys)), names)
        cost.set_ylabel("decode tok/s, no pressure")
        cost.set_title("A/B/A: preemption on / off", fontsize=9)
        cost.set_ylim(bottom=0)
        cost.grid(True, axis="y", alpha=0.3)
        cost.legend(fontsize=7)
    else:
        cost.axis("off")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
