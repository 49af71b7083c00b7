"""Prometheus metrics (``kvpark_`` prefix) in a registry of our own.

Gauges and counters are read from ``engine.stats()`` at scrape time (the engine keeps the totals; a
collector reports them), so nothing on the hot path touches Prometheus. Histograms are fed at scrape
time from ``engine.drain_observations()``, the samples the engine recorded since the previous
scrape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREEMPT_MODES = ("swap", "recompute")

# name -> (help, buckets in seconds)
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "time_to_first_token_seconds": (
        "Time from a request's arrival to its first generated token",
        (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
    ),
    "inter_token_latency_seconds": (
        "Time between two generated tokens of one sequence (parks included)",
        (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0, 10.0),
    ),
    "park_duration_seconds": (
        "Time a request spent out of decoding per park, from park to resume",
        (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0),
    ),
    "transfer_duration_seconds": (
        "Time one swap copy (out or back in) took",
        (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
    ),
}


class StatsLike(Protocol):
    requests_running: int
    requests_waiting: int
    requests_preempted: int
    kv_cells_used: int
    kv_cells_cached: int
    kv_cells_total: int
    kv_window_cells_used: int
    kv_window_cells_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prompt_tokens_total: int
    generated_tokens_total: int
    preemptions_total: dict[str, int]
    resumes_total: int
    rotations_total: int
    recomputed_tokens_total: int
    preempt_ram_bytes: int


class EngineLike(Protocol):
    ready: bool

    def stats(self) -> StatsLike: ...

    def drain_observations(self) -> dict[str, list[float]]: ...


class EngineCollector:
    """Reports the engine's gauges and counters as they are at scrape time."""

    def __init__(self, engine: EngineLike) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        if not self.engine.ready:
            return
        s = self.engine.stats()
        yield _gauge("requests_running", "Requests taking part in decoding", s.requests_running)
        yield _gauge("requests_waiting", "Requests queued for a slot", s.requests_waiting)
        yield _gauge(
            "requests_preempted",
            "Requests out of decoding because of preemption: parked plus copies in flight",
            s.requests_preempted,
        )
        yield _gauge("kv_cells_used", "KV cells held by sequences", s.kv_cells_used)
        yield _gauge(
            "kv_cells_cached",
            "KV cells in cached pages: held by no sequence, kept for later prompts",
            s.kv_cells_cached,
        )
        yield _gauge("kv_cells_total", "KV cells in the pool", s.kv_cells_total)
        ratio = s.kv_cells_used / s.kv_cells_total if s.kv_cells_total else 0.0
        yield _gauge("kv_usage_ratio", "Fraction of the KV pool in use", ratio)
        if s.kv_window_cells_total:  # only a model whose sliding layers keep a window space
            yield _gauge(
                "kv_window_cells_used",
                "Cells the sliding layers' window space holds for sequences",
                s.kv_window_cells_used,
            )
            yield _gauge(
                "kv_window_cells_total",
                "Cells in the sliding layers' window space",
                s.kv_window_cells_total,
            )
        yield _gauge(
            "preempt_ram_bytes", "Host bytes held for parked requests", s.preempt_ram_bytes
        )
        yield _counter(
            "prompt_tokens", "Prompt tokens processed (replays excluded)", s.prompt_tokens_total
        )
        yield _counter("generation_tokens", "Tokens generated", s.generated_tokens_total)
        yield _counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission",
            s.prefix_cache_queries_total,
        )
        yield _counter(
            "prefix_cache_hits",
            "Prompt tokens the prefix cache supplied at admission",
            s.prefix_cache_hits_total,
        )
        parks = CounterMetricFamily(
            "kvpark_preemptions", "Requests parked, by mode", labels=["mode"]
        )
        for mode in PREEMPT_MODES:
            parks.add_metric([mode], s.preemptions_total.get(mode, 0))
        yield parks
        yield _counter("resumes", "Parked requests resumed", s.resumes_total)
        yield _counter(
            "rotations",
            "Residents parked to give a long-parked request its turn",
            s.rotations_total,
        )
        yield _counter(
            "recomputed_tokens", "Tokens replayed by recompute resumes", s.recomputed_tokens_total
        )


class ServerMetrics:
    """The registry behind ``GET /metrics``."""

    def __init__(self, engine: EngineLike) -> None:
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine))
        self.histograms = {
            name: Histogram(f"kvpark_{name}", text, buckets=buckets, registry=self.registry)
            for name, (text, buckets) in HISTOGRAMS.items()
        }

    def render(self) -> bytes:
        if self.engine.ready:
            for name, samples in self.engine.drain_observations().items():
                histogram = self.histograms.get(name)
                if histogram is not None:
                    for value in samples:
                        histogram.observe(value)
        return generate_latest(self.registry)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"kvpark_{name}", text, value=value)


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"kvpark_{name}", text, value=value)
