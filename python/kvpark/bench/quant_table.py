"""The quant-types benchmark's numbers (``suites/quant_types.py``): each server's figures on one
file, the issue's targets judged kvpark / llama-server per type, and the docs/benchmarks.md table.

Per type and server: single-stream decode tok/s (the median over the 1-chat level), aggregate
tok/s and the median request's decode tok/s at the top level (8 chats), prefill tok/s (the median
over its requests of prompt tokens / TTFT, a one-token answer to a long prompt) and the peak
resident memory of the server's process tree; over several rounds (``--rounds``), each rate's
median and the largest peak. The targets, per type, against llama-server in the same run: single
stream >= 1.0x, aggregate at 8 chats >= 2.0x, prefill >= 1.0x, peak RSS <= 1.1x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpark.bench.client import RequestResult
from kvpark.bench.cpu_targets import Goal, ratio
from kvpark.bench.report import RunResult, percentile

OURS, BASELINE = "kvpark", "llama-server"


def goals(top: int) -> tuple[Goal, ...]:
    """The issue's targets; the aggregate one at the run's top level (8 chats by default)."""
    return (
        Goal("single-stream decode tok/s", 1.0),
        Goal(f"aggregate tok/s at {top} chats", 2.0),
        Goal("prefill tok/s", 1.0),
        Goal("peak resident memory", 1.1, at_most=True),
    )


SHORT = ("single", "aggregate", "prefill", "RSS")  # the goals' names in the table's last column


@dataclass(frozen=True)
class Figures:
    """One server on one file; None where it was not measured."""

    single_tok_s: float | None
    aggregate_tok_s: float | None  # at the top level
    decode_tok_s: float | None  # the median request's, at the top level
    prefill_tok_s: float | None
    peak_mib: float | None

    def judged(self) -> tuple[float | None, ...]:
        """The figures the goals read, in their order."""
        return (self.single_tok_s, self.aggregate_tok_s, self.prefill_tok_s, self.peak_mib)


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def prefill_summary(results: list[RequestResult]) -> dict[str, Any]:
    """Prompt tokens / TTFT of each request that came back with both, and their median (``tok_s``,
    None when none did); the prompt tokens the prefix cache supplied, to show there were none."""
    rates, prompts, ttfts = [], [], []
    for r in results:
        ttft = r.ttft_s
        if r.ok and r.prompt_tokens and ttft is not None and ttft > 0:
            rates.append(r.prompt_tokens / ttft)
            prompts.append(r.prompt_tokens)
            ttfts.append(ttft)
    return {
        "tok_s": percentile(rates, 50) if rates else None,
        "per_request_tok_s": rates,
        "prompt_tokens": prompts,
        "ttft_s": ttfts,
        "cached_tokens": [r.cached_tokens for r in results],
        "errors": [r.error for r in results if not r.ok],
    }


def figures(
    run: RunResult, prefill: dict[str, Any] | None, peak_mib: float | None, top: int
) -> Figures:
    level = run.level(top)
    return Figures(
        single_tok_s=finite(run.single_stream_decode_tok_s),
        aggregate_tok_s=finite(level.aggregate_tok_s) if level else None,
        decode_tok_s=finite(level.decode_tok_s_p50) if level else None,
        prefill_tok_s=finite((prefill or {}).get("tok_s")),
        peak_mib=peak_mib,
    )


def median_figures(rounds: list[Figures]) -> Figures:
    """One server's figures over several rounds: each rate the median of the rounds that measured
    it (None where none did), the peak memory the largest (the target is an upper bound)."""

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return percentile(known, 50) if known else None

    peaks = [f.peak_mib for f in rounds if f.peak_mib is not None]
    return Figures(
        single_tok_s=median([f.single_tok_s for f in rounds]),
        aggregate_tok_s=median([f.aggregate_tok_s for f in rounds]),
        decode_tok_s=median([f.decode_tok_s for f in rounds]),
        prefill_tok_s=median([f.prefill_tok_s for f in rounds]),
        peak_mib=max(peaks) if peaks else None,
    )


def judge(ours: Figures, base: Figures | None, top: int) -> list[dict[str, Any]]:
    """Each goal's ratio (kvpark / llama-server) and verdict (None: not measured)."""
    theirs = base.judged() if base else (None,) * 4
    out = []
    for goal, mine, other in zip(goals(top), ours.judged(), theirs, strict=True):
        value = ratio(mine, other)
        out.append({"goal": goal.name, "ratio": value, "target": goal.target,
                    "at_most": goal.at_most, "met": goal.met(value, goal.target)})  # fmt: skip
    return out


@dataclass(frozen=True)
class TypeRow:
    """One type's line of the table."""

    qtype: str
    file_mib: float
    runner: str | None  # the kvpark runner that served it (its /props)
    ours: Figures
    base: Figures | None
    verdicts: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.qtype,
            "file_mib": round(self.file_mib, 1),
            "kvpark_runner": self.runner,
            OURS: self.ours.__dict__,
            BASELINE: self.base.__dict__ if self.base else None,
            "targets": self.verdicts,
        }


def _num(value: float | None, digits: int = 1) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f}".replace(",", " ")


def cell(ours: float | None, base: float | None, digits: int = 1) -> str:
    """``kvpark / llama-server (ratio×)``; ``kvpark / -`` without a peer."""
    shown = f"{_num(ours, digits)} / {_num(base, digits)}"
    value = ratio(ours, base)
    return shown if value is None else f"{shown} ({value:.2f}×)"


def met_cell(verdicts: list[dict[str, Any]]) -> str:
    """``4/4``, ``2/4 (not: aggregate, RSS)``, or ``-`` when nothing was judged."""
    judged = [(name, v["met"]) for name, v in zip(SHORT, verdicts, strict=True)]
    known = [(name, met) for name, met in judged if met is not None]
    if not known:
        return "-"
    missed = [name for name, met in known if not met]
    text = f"{len(known) - len(missed)}/{len(known)}"
    return text + (f" (not: {', '.join(missed)})" if missed else "")


def markdown_rows(rows: list[TypeRow], top: int, prefill_tokens: int) -> list[str]:
    """docs/benchmarks.md's table: one line per type, each cell kvpark / llama-server (ratio)."""
    out = [
        f"| type | file MiB | kvpark runner | single-stream decode tok/s | aggregate tok/s at "
        f"{top} chats | decode tok/s per request at {top} | prefill tok/s (~{prefill_tokens} "
        "tokens) | peak RSS MiB | targets met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        o, b = row.ours, row.base or Figures(None, None, None, None, None)
        out.append(
            f"| {row.qtype} | {_num(row.file_mib)} | {row.runner or '-'} "
            f"| {cell(o.single_tok_s, b.single_tok_s)} "
            f"| {cell(o.aggregate_tok_s, b.aggregate_tok_s)} "
            f"| {cell(o.decode_tok_s, b.decode_tok_s)} "
            f"| {cell(o.prefill_tok_s, b.prefill_tok_s, 0)} "
            f"| {cell(o.peak_mib, b.peak_mib, 0)} | {met_cell(row.verdicts)} |"
        )
    return out


def format_verdicts(rows: list[TypeRow]) -> str:
    """One line per type and goal: ratio, target, MET / NOT MET / not measured."""

    def word(met: bool | None) -> str:
        return "not measured" if met is None else ("MET" if met else "NOT MET")

    lines = [f"targets ({OURS} / {BASELINE}, per type):"]
    for row in rows:
        for v in row.verdicts:
            shown = "-" if v["ratio"] is None else f"{v['ratio']:.2f}x"
            sign = "<=" if v["at_most"] else ">="
            lines.append(f"  {row.qtype:7} {v['goal']}: {shown} (target {sign} {v['target']:g}x)"
                         f": {word(v['met'])}")  # fmt: skip
    return "\n".join(lines)
