"""The headline benchmark: N chats that each fit the pool alone but not together (SPEC §7).

The ``pressure`` scenario (``kvpark bench --scenario pressure``, registered in ``scenarios.py``)
sends, per level, N seeded chats at once to one server and records every request (see
``client.py``); this module turns those records into the level summary, reads parks by mode from
the server's ``/metrics``, checks the goals, and prints and plots the result:

- **completed** / **context errors** (the error says "Context size has been exceeded.") / **other
  errors**;
- **parks by mode**: the increase of ``kvpark_preemptions_total{mode="swap"|"recompute"}`` over the
  level (and of ``kvpark_recomputed_tokens_total``, resumes and rotations), with the ``: preempted``
  notices and the final ``preempt`` records of the streams as a cross-check;
- **wall time** (the level's first send to its last answer), **aggregate tok/s** (tokens of the
  completed requests / wall time), **p95 gap** between tokens (every gap of every request, failed
  ones up to their failure, pooled), TTFT p50/p95.

``bench/run_pressure.py`` runs it against ``--no-preempt``, ``--preempt-ram 0`` and the default
plus the A/B/A no-pressure check, and uses ``evaluate_goals`` and ``write_pressure_plot``.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx

from kvpark.bench.client import RequestResult, Target
from kvpark.bench.report import RunResult, percentile

CONTEXT_ERROR = "Context size has been exceeded."

# The three server configurations of the headline run: label, the `kvpark serve` flags it adds.
MODES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("no-preempt", ("--no-preempt",)),  # llama.cpp's behaviour: an overflow fails requests
    ("recompute-only", ("--preempt-ram", "0")),  # vLLM's behaviour: every park recomputes
    ("default", ()),  # swap within --preempt-ram (2048 MiB), else recompute
)
BASELINE = "no-preempt"
RECOMPUTE_ONLY = "recompute-only"
DEFAULT = "default"
GOAL_WALL_RATIO = 0.8  # default's wall time at most 0.8x recompute-only's
GOAL_DECODE_RATIO = 0.98  # with no pressure, preemption on costs at most 2 % decode tok/s

# (metric name, mode label or None) -> key in a metrics snapshot
_METRIC_KEYS: dict[tuple[str, str | None], str] = {
    ("kvpark_preemptions_total", "swap"): "parks_swap",
    ("kvpark_preemptions_total", "recompute"): "parks_recompute",
    ("kvpark_recomputed_tokens_total", None): "recomputed_tokens",
    ("kvpark_resumes_total", None): "resumes",
    ("kvpark_rotations_total", None): "rotations",
}
METRIC_FIELDS = tuple(_METRIC_KEYS.values())
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, float]:
    """The preemption counters of a Prometheus text page (missing ones are left out)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        mode = dict(_LABEL.findall(labels or "")).get("mode")
        key = _METRIC_KEYS.get((name, mode))
        if key is not None:
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def metrics_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, int] | None:
    """How much each counter grew over a level; None when either scrape failed."""
    if before is None or after is None:
        return None
    return {k: round(after[k] - before.get(k, 0.0)) for k in METRIC_FIELDS if k in after}


async def scrape_metrics(target: Target, timeout_s: float = 30.0) -> dict[str, float] | None:
    """The preemption counters of ``GET /metrics``; None when the server has no such page."""
    text = await _get(target, "/metrics", timeout_s)
    return None if text is None else parse_metrics(text)


async def fetch_props(target: Target, timeout_s: float = 30.0) -> dict[str, Any] | None:
    """kvpark's ``GET /props`` (pool and preemption settings); None for other servers."""
    text = await _get(target, "/props", timeout_s)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


async def _get(target: Target, path: str, timeout_s: float) -> str | None:
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            response = await client.get(target.url.rstrip("/") + path, headers=target.headers())
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def is_context_error(error: str | None) -> bool:
    return error is not None and CONTEXT_ERROR in error


@dataclass(frozen=True)
class PressureLevel:
    """One level (N chats at once) against one server. Seconds; NaN or None: not measured."""

    chats: int
    requests: int
    completed: int
    context_errors: int
    other_errors: int
    wall_s: float
    tokens_out: int  # by completed requests
    tokens_streamed: int  # every token chunk seen, failed requests' included
    aggregate_tok_s: float  # tokens_out / wall_s
    itl_p50_s: float  # every gap between tokens of every request, pooled
    itl_p95_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    notices: dict[str, int] = field(default_factory=dict)  # preempted / resumed / recomputed ...
    preempt_parks: int | None = None  # sum of the streams' final preempt records
    preempt_recomputes: int | None = None
    parks_swap: int | None = None  # from /metrics, over the level
    parks_recompute: int | None = None
    recomputed_tokens: int | None = None
    resumes: int | None = None
    rotations: int | None = None
    prompt_tokens_max: int | None = None  # largest usage.prompt_tokens (what the server counted)
    first_errors: list[str] = field(default_factory=list)

    @property
    def parks(self) -> int | None:
        if self.parks_swap is None or self.parks_recompute is None:
            return None
        return self.parks_swap + self.parks_recompute

    def to_json(self) -> dict[str, Any]:
        return {k: _finite(v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PressureLevel:
        floats = {f.name for f in fields(cls) if f.type in ("float", float)}
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {
            k: (math.nan if v is None and k in floats else v) for k, v in data.items() if k in known
        }
        return cls(**values)


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _sum_preempt(results: list[RequestResult], key: str) -> int | None:
    records = [r.preempt for r in results if r.preempt is not None]
    if not records:
        return None
    return sum(int(rec.get(key) or 0) for rec in records)


def summarize_pressure(
    chats: int,
    wall_s: float,
    results: list[RequestResult],
    delta: dict[str, int] | None = None,
) -> PressureLevel:
    """The level summary of ``results`` (see the module docstring for the definitions)."""
    completed = [r for r in results if r.ok]
    context = [r for r in results if not r.ok and is_context_error(r.error)]
    tokens = sum(r.tokens_out for r in completed)
    gaps = [g for r in results for g in r.itl_s]
    ttfts = [t for r in results if (t := r.ttft_s) is not None]
    prompts = [r.prompt_tokens for r in results if isinstance(r.prompt_tokens, int)]
    words = Counter(text.split()[0] for r in results for _, text in r.notices if text.split())
    metric = delta or {}
    return PressureLevel(
        chats=chats,
        requests=len(results),
        completed=len(completed),
        context_errors=len(context),
        other_errors=len(results) - len(completed) - len(context),
        wall_s=wall_s,
        tokens_out=tokens,
        tokens_streamed=sum(r.chunks for r in results),
        aggregate_tok_s=tokens / wall_s if wall_s > 0 else math.nan,
        itl_p50_s=percentile(gaps, 50),
        itl_p95_s=percentile(gaps, 95),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        notices=dict(words),
        preempt_parks=_sum_preempt(results, "parks"),
        preempt_recomputes=_sum_preempt(results, "recomputes"),
        parks_swap=metric.get("parks_swap"),
        parks_recompute=metric.get("parks_recompute"),
        recomputed_tokens=metric.get("recomputed_tokens"),
        resumes=metric.get("resumes"),
        rotations=metric.get("rotations"),
        prompt_tokens_max=max(prompts) if prompts else None,
        first_errors=[r.error for r in results if r.error][:3],
    )


def admitted_together(prompt_tokens: int, chats: int, kv_cells: int, page_size: int) -> int:
    """How many of ``chats`` equal prompts kvpark admits into an empty pool at once: a prompt is let
    in when its pages plus a page of headroom per sequence already running fit (the scheduler's
    admission rule). Below 2 the chats run one after another and never press on each other."""
    total = kv_cells // page_size
    pages = -(-prompt_tokens // page_size)
    used = admitted = 0
    while admitted < chats and used + pages + admitted <= total:
        used += pages
        admitted += 1
    return admitted


def fit_check(
    props: dict[str, Any] | None, chats: int, prompt_tokens: int | None, max_tokens: int
) -> dict[str, Any] | None:
    """Whether a level really was "each fits alone, not together", from ``/props``'s pool and the
    prompt length the server counted; None when either is unknown. ``under_pressure``: a chat fits
    the pool alone, the chats that can hold a slot do not fit together, and at least two of them
    are admitted at once."""
    pool = (props or {}).get("pool")
    if not isinstance(pool, dict) or prompt_tokens is None:
        return None
    cells, slots = int(pool["kv_cells"]), int(pool["parallel"])
    page_size = int(pool.get("page_size") or 16)
    per_chat = prompt_tokens + max_tokens
    together = min(chats, slots) * per_chat
    admitted = admitted_together(prompt_tokens, min(chats, slots), cells, page_size)
    return {
        "kv_cells": cells,
        "parallel": slots,
        "page_size": page_size,
        "cells_per_chat": per_chat,
        "cells_together": together,
        "admitted_together": admitted,
        "fits_alone": per_chat <= cells,
        "fits_together": together <= cells,
        "under_pressure": per_chat <= cells < together and admitted >= 2,
    }


def pressure_levels(run: RunResult) -> list[PressureLevel]:
    """The pressure summaries a ``pressure`` run carries (none for other scenarios)."""
    return [PressureLevel.from_json(d) for d in run.extra.get("pressure", [])]


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def format_pressure_table(runs: list[RunResult]) -> str:
    """One row per server and level: outcomes, parks by mode, wall time, tok/s, p95 gap."""
    width = max([5, *(len(run.label) for run in runs)])
    head = (
        f"{'label':<{width}} {'chats':>5} {'done':>4} {'ctx err':>7} {'other':>5} "
        f"{'swap':>5} {'recomp':>6} {'replayed':>8} {'wall s':>7} {'agg tok/s':>9} "
        f"{'gap p50':>7} {'p95':>6} {'ttft p95':>8}"
    )
    lines = [head, "-" * len(head)]
    for run in runs:
        for lv in pressure_levels(run):
            lines.append(
                f"{run.label:<{width}} {lv.chats:>5} {lv.completed:>4} {lv.context_errors:>7} "
                f"{lv.other_errors:>5} {_opt(lv.parks_swap):>5} {_opt(lv.parks_recompute):>6} "
                f"{_opt(lv.recomputed_tokens):>8} {lv.wall_s:>7.1f} {lv.aggregate_tok_s:>9.1f} "
                f"{_ms(lv.itl_p50_s):>7} {_ms(lv.itl_p95_s):>6} {_ms(lv.ttft_p95_s):>8}"
            )
    lines.append(
        "(swap/recomp: parks by mode from /metrics; replayed: recomputed tokens; gaps and TTFT in "
        "ms; agg tok/s: tokens of completed requests / wall)"
    )
    return "\n".join(lines)


# --- the no-pressure A/B/A check --------------------------------------------------------------


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
            "decode_tok_s": [_finite(v) for v in values],
            "a_mean": _finite(a_mean),
            "ratio": _finite(_ratio(a_mean, values[1])),
            "a_spread": _finite(_ratio(abs(values[0] - values[2]), a_mean)),
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
                ratios[str(chats)] = _finite(_ratio(lv.wall_s, other.wall_s))
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
) -> Path:
    """A 2×3 PNG of bars, one group per level (N chats), one bar per server: completed / context
    errors / other errors, wall time, aggregate tok/s, p95 gap, parks by mode (swap / recompute),
    and the A/B/A no-pressure decode tok/s when given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
