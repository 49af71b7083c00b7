"""From request records to numbers: percentiles, per-level summaries, a table, JSON and a PNG plot.

Definitions (the ones ``docs/benchmarks.md`` quotes):
- aggregate tok/s of a level = tokens out by all its requests / the level's wall time;
- a request's decode tok/s = (tokens − 1) / (last token time − first token time);
- single-stream decode tok/s = the median of that over the requests of the concurrency-1 level;
- TTFT = first token time − send time;
- ITL = every gap between consecutive token chunks, pooled over a level's requests.
Percentiles interpolate linearly between closest ranks (numpy's default ``linear`` method).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpark.bench.client import RequestResult


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between ranks; NaN if empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be within 0..100")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class LevelSummary:
    """One concurrency level of one server. Times in seconds; NaN where nothing was measured."""

    concurrency: int
    requests: int
    ok: int
    errors: int
    wall_s: float
    tokens_out: int
    aggregate_tok_s: float
    decode_tok_s_p50: float
    ttft_p50_s: float
    ttft_p95_s: float
    itl_p50_s: float
    itl_p95_s: float
    parks: int  # ``: preempted`` notices seen (prompt-indexed ones included)
    notices: dict[str, int] = field(default_factory=dict)  # every comment word seen, counted
    first_errors: list[str] = field(default_factory=list)  # up to three, to say what went wrong


def summarize_level(concurrency: int, wall_s: float, results: list[RequestResult]) -> LevelSummary:
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens_out for r in ok)
    ttfts = [t for r in ok if (t := r.ttft_s) is not None]
    decode = [d for r in ok if (d := r.decode_tok_s) is not None]
    gaps = [g for r in ok for g in r.itl_s]
    words = Counter(text.split()[0] for r in results for _, text in r.notices)
    return LevelSummary(
        concurrency=concurrency,
        requests=len(results),
        ok=len(ok),
        errors=len(results) - len(ok),
        wall_s=wall_s,
        tokens_out=tokens,
        aggregate_tok_s=tokens / wall_s if wall_s > 0 else math.nan,
        decode_tok_s_p50=percentile(decode, 50),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        itl_p50_s=percentile(gaps, 50),
        itl_p95_s=percentile(gaps, 95),
        parks=words.get("preempted", 0),
        notices=dict(words),
        first_errors=[r.error for r in results if r.error][:3],
    )


def request_record(result: RequestResult) -> dict[str, Any]:
    """A request as JSON: its derived numbers and its raw chunk times (rounded to 10 µs)."""
    return {
        "index": result.index,
        "ok": result.ok,
        "error": result.error,
        "sent_s": round(result.sent_s, 5),
        "done_s": round(result.done_s, 5),
        "ttft_s": result.ttft_s,
        "tokens_out": result.tokens_out,
        "chunks": result.chunks,
        "usage_tokens": result.usage_tokens,
        "prompt_tokens": result.prompt_tokens,
        "finish_reason": result.finish_reason,
        "decode_tok_s": result.decode_tok_s,
        "token_s": [round(t, 5) for t in result.token_s],
        "notices": [[round(t, 5), text] for t, text in result.notices],
        "pings": result.pings,
        "timings": result.timings,
        "preempt": result.preempt,
    }


@dataclass
class RunResult:
    """One scenario against one server: the levels in order, and every request's record."""

    label: str
    url: str
    model: str
    scenario: str
    options: dict[str, Any]
    levels: list[LevelSummary] = field(default_factory=list)
    requests: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # by concurrency
    extra: dict[str, Any] = field(default_factory=dict)  # a scenario's own results (JSON-ready)

    @property
    def single_stream_decode_tok_s(self) -> float:
        return next((lv.decode_tok_s_p50 for lv in self.levels if lv.concurrency == 1), math.nan)

    @property
    def errors(self) -> int:
        return sum(lv.errors for lv in self.levels)

    def level(self, concurrency: int) -> LevelSummary | None:
        return next((lv for lv in self.levels if lv.concurrency == concurrency), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "url": self.url,
            "model": self.model,
            "scenario": self.scenario,
            "options": self.options,
            "single_stream_decode_tok_s": _finite(self.single_stream_decode_tok_s),
            "levels": [{k: _finite(v) for k, v in asdict(lv).items()} for lv in self.levels],
            "requests": {str(c): records for c, records in self.requests.items()},
            **({"extra": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunResult:
        """The inverse of ``to_json`` (null numbers come back as NaN), e.g. to plot again."""
        levels = []
        for level in data["levels"]:
            fields: dict[str, Any] = {k: math.nan if v is None else v for k, v in level.items()}
            levels.append(LevelSummary(**fields))
        requests = {int(c): records for c, records in data.get("requests", {}).items()}
        return cls(data["label"], data["url"], data["model"], data["scenario"], data["options"],
                   levels, requests, dict(data.get("extra") or {}))  # fmt: skip


def _finite(value: Any) -> Any:
    """NaN is not JSON: write null instead."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def format_table(runs: list[RunResult]) -> str:
    """A plain-text table, one row per server and level."""
    width = max([5, *(len(run.label) for run in runs)])
    head = (
        f"{'label':<{width}} {'conc':>4} {'reqs':>4} {'err':>3} {'tokens':>6} {'wall s':>7} "
        f"{'agg tok/s':>9} {'dec tok/s':>9} {'ttft p50':>8} {'p95':>6} {'itl p50':>7} {'p95':>5} "
        f"{'parks':>5}"
    )
    lines = [head, "-" * len(head)]
    for run in runs:
        for lv in run.levels:
            decode = "-" if math.isnan(lv.decode_tok_s_p50) else f"{lv.decode_tok_s_p50:.1f}"
            lines.append(
                f"{run.label:<{width}} {lv.concurrency:>4} {lv.requests:>4} {lv.errors:>3} "
                f"{lv.tokens_out:>6} {lv.wall_s:>7.2f} {lv.aggregate_tok_s:>9.1f} {decode:>9} "
                f"{_ms(lv.ttft_p50_s):>8} {_ms(lv.ttft_p95_s):>6} {_ms(lv.itl_p50_s):>7} "
                f"{_ms(lv.itl_p95_s):>5} {lv.parks:>5}"
            )
    lines.append("(times in ms; dec tok/s: median per-request decode rate)")
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    return path


PLOT_SKIPPED = "plot skipped: matplotlib is not installed (pip install 'kvpark[bench]')"


def pyplot() -> Any | None:
    """matplotlib's pyplot on the file-only Agg backend, or None (with a one-line note) when the
    optional ``kvpark[bench]`` extra is not installed: the JSON is written either way."""
    try:
        import matplotlib
    except ImportError:
        print(PLOT_SKIPPED)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plot(path: Path, runs: list[RunResult], title: str = "kvpark bench") -> Path | None:
    """A 2×2 PNG: aggregate tok/s, TTFT p50/p95, ITL p50/p95 and parks, each against concurrency;
    None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    (thr, ttft), (itl, parks) = axes
    levels = sorted({lv.concurrency for run in runs for lv in run.levels})
    for run in runs:
        xs = [lv.concurrency for lv in run.levels]
        line = thr.plot(xs, [lv.aggregate_tok_s for lv in run.levels], "o-", label=run.label)[0]
        color = line.get_color()
        ttft.plot(
            xs,
            [lv.ttft_p50_s * 1000 for lv in run.levels],
            "o-",
            color=color,
            label=f"{run.label} p50",
        )
        ttft.plot(
            xs,
            [lv.ttft_p95_s * 1000 for lv in run.levels],
            "x--",
            color=color,
            label=f"{run.label} p95",
        )
        itl.plot(
            xs,
            [lv.itl_p50_s * 1000 for lv in run.levels],
            "o-",
            color=color,
            label=f"{run.label} p50",
        )
        itl.plot(
            xs,
            [lv.itl_p95_s * 1000 for lv in run.levels],
            "x--",
            color=color,
            label=f"{run.label} p95",
        )
        parks.plot(xs, [lv.parks for lv in run.levels], "o-", color=color, label=run.label)
    for ax, ylabel in (
        (thr, "aggregate tokens/s"),
        (ttft, "time to first token (ms)"),
        (itl, "inter-token latency (ms)"),
        (parks, "parks (: preempted notices)"),
    ):
        ax.set_xlabel("concurrent chats")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    most_parks = max((lv.parks for run in runs for lv in run.levels), default=0)
    parks.set_ylim(0, max(1, most_parks) * 1.1)
    parks.yaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
