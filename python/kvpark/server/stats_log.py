"""The server's periodic stats line (``--log-stats-interval``), as vLLM logs one:

    prompt throughput: 210.4 tok/s, generation throughput: 48.0 tok/s, running: 3, waiting: 1,
    parked: 1, KV cache usage: 37.5%, preemptions: 4 (swap 3, recompute 1)

It reads ``AsyncEngine.stats()`` (a copy of the engine's counters, safe off the engine thread) once
an interval and stays quiet while the server is idle, so an idle server's log does not grow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from kvpark.engine.stats import EngineStats

log = logging.getLogger("kvpark.engine.stats")


class StatsSource(Protocol):
    def stats(self) -> EngineStats: ...


@dataclass(frozen=True)
class TokenCounts:
    """The two counters a throughput is a difference of, and when they were read."""

    at: float  # time.monotonic()
    prompt_tokens: int
    generated_tokens: int

    @classmethod
    def read(cls, stats: EngineStats, at: float) -> TokenCounts:
        return cls(at, stats.prompt_tokens_total, stats.generated_tokens_total)


def is_active(stats: EngineStats, since: TokenCounts) -> bool:
    """Whether a line is worth logging: requests are in the engine, or tokens came since the last
    line (a request that finished between two reads still gets its throughput logged once)."""
    in_engine = stats.requests_running + stats.requests_waiting + stats.requests_preempted
    produced = (stats.prompt_tokens_total, stats.generated_tokens_total) != (
        since.prompt_tokens,
        since.generated_tokens,
    )
    return in_engine > 0 or produced


def stats_line(stats: EngineStats, now: TokenCounts, before: TokenCounts) -> str:
    elapsed = max(now.at - before.at, 1e-9)
    prompt_rate = (now.prompt_tokens - before.prompt_tokens) / elapsed
    generation_rate = (now.generated_tokens - before.generated_tokens) / elapsed
    usage = 100.0 * stats.kv_cells_used / stats.kv_cells_total if stats.kv_cells_total else 0.0
    swaps = stats.preemptions_total.get("swap", 0)
    recomputes = stats.preemptions_total.get("recompute", 0)
    return (
        f"prompt throughput: {prompt_rate:.1f} tok/s, "
        f"generation throughput: {generation_rate:.1f} tok/s, "
        f"running: {stats.requests_running}, waiting: {stats.requests_waiting}, "
        f"parked: {stats.requests_preempted}, KV cache usage: {usage:.1f}%, "
        f"preemptions: {swaps + recomputes} (swap {swaps}, recompute {recomputes})"
    )


async def log_stats_every(engine: StatsSource, interval_s: float) -> None:
    """Log a stats line every ``interval_s`` seconds while the engine is active; runs until
    cancelled. Note: call only with ``interval_s > 0`` (0 means the line is off)."""
    assert interval_s > 0, "a stats interval of 0 means off: do not start the task"
    before = TokenCounts.read(engine.stats(), time.monotonic())
    while True:
        await asyncio.sleep(interval_s)
        stats = engine.stats()
        if is_active(stats, before):
            now = TokenCounts.read(stats, time.monotonic())
            log.info("%s", stats_line(stats, now, before))
            before = now
        else:
            # idle: restart the window, so the next line's throughput covers only its interval
            before = TokenCounts.read(stats, time.monotonic())
