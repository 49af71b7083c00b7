"""Engine counters and latency samples, read by the server's /metrics without touching the engine
thread.

Counters only grow; gauges are computed on demand. Latency samples queue up until ``drain()``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

OBSERVATION_KEYS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "park_duration_seconds",
    "transfer_duration_seconds",
)
MAX_PENDING_SAMPLES = 100_000  # a server nobody scrapes must not grow without bound


@dataclass
class EngineStats:
    requests_running: int = 0
    requests_waiting: int = 0
    requests_preempted: int = 0
    kv_cells_used: int = 0
    kv_cells_cached: int = 0  # in cached pages: held by no sequence, found by later prompts
    kv_cells_total: int = 0
    # the sliding layers' own cells (sched/window_space.py); total 0: no window space
    kv_window_cells_used: int = 0
    kv_window_cells_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits_total: int = 0  # of those, tokens the cache supplied
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    preemptions_total: dict[str, int] = field(default_factory=lambda: {"swap": 0, "recompute": 0})
    resumes_total: int = 0
    rotations_total: int = 0
    recomputed_tokens_total: int = 0
    preempt_ram_bytes: int = 0
    requests_finished_total: int = 0
    steps_total: int = 0


class Observations:
    """Thread-safe queue of latency samples per histogram name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: dict[str, list[float]] = {k: [] for k in OBSERVATION_KEYS}

    def add(self, key: str, value: float) -> None:
        with self._lock:
            bucket = self._samples[key]
            if len(bucket) < MAX_PENDING_SAMPLES:
                bucket.append(value)

    def drain(self) -> dict[str, list[float]]:
        with self._lock:
            out, self._samples = self._samples, {k: [] for k in OBSERVATION_KEYS}
        return out
