"""The headline benchmark: N chats that each fit the pool alone but not together.

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

``kvpark bench --scenario pressure`` (suites/pressure.py) runs it against ``--no-preempt``,
``--preempt-ram 0`` and the default plus the A/B/A no-pressure check, and uses
``evaluate_goals`` and ``write_pressure_plot``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvpark.bench.client import RequestResult
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
        return {k: finite(v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PressureLevel:
        floats = {f.name for f in fields(cls) if f.type in ("float", float)}
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {
            k: (math.nan if v is None and k in floats else v) for k, v in data.items() if k in known
        }
        return cls(**values)


def finite(value: Any) -> Any:
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
