"""What the soak reads from the server besides its answers: ``/metrics`` gauges and counters,
the process's resident memory, a sampler that records both over the run, and the lines of the
server's log that say how its failed steps and its last integrity check went.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

SAMPLED = (
    "kvpark_kv_cells_used",
    "kvpark_kv_cells_cached",
    "kvpark_requests_running",
    "kvpark_requests_waiting",
    "kvpark_requests_preempted",
    "kvpark_preempt_ram_bytes",
)
FAULT_LINE = "a step failed (RuntimeError: KVPARK_FAULT_STEP="
STEP_CHECKED = "the KV pool's integrity check passed after a failed step"
SHUTDOWN_CHECKED = "the KV pool's integrity check passed after serving (shutdown)"
FAULT_MESSAGE = "internal error while running the model"  # what a failed step's requests get


def parse_samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus page by name; a labelled one as ``name{label=value}``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


async def metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    response = await client.get(base_url.rstrip("/") + "/metrics")
    response.raise_for_status()
    return parse_samples(response.text)


def rss_bytes(pid: int) -> int:
    """The process's resident set (``VmRSS``), in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no VmRSS for process {pid}")
    return int(match.group(1)) * 1024


@dataclass
class Sampler:
    """Records ``SAMPLED`` and the RSS every ``period_s`` until stopped: the plot's series."""

    base_url: str
    pid: int
    period_s: float = 0.5
    series: list[dict[str, float]] = field(default_factory=list)
    _start: float = field(default_factory=time.perf_counter)

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            while not stop.is_set():
                try:
                    page = await metrics(client, self.base_url)
                except httpx.HTTPError:
                    page = {}
                row = {"t_s": time.perf_counter() - self._start, "rss_bytes": rss_bytes(self.pid)}
                row.update({name: page[name] for name in SAMPLED if name in page})
                self.series.append(row)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.period_s)


@dataclass(frozen=True)
class LogFacts:
    faults_fired: int  # steps that KVPARK_FAULT_STEP failed
    step_checks_passed: int  # integrity checks passed after a failed step
    shutdown_check_passed: bool
    tracebacks: int  # "Traceback" lines: none is expected

    @classmethod
    def read(cls, path: Path) -> LogFacts:
        text = path.read_text(errors="replace")
        return cls(
            faults_fired=text.count(FAULT_LINE),
            step_checks_passed=text.count(STEP_CHECKED),
            shutdown_check_passed=SHUTDOWN_CHECKED in text,
            tracebacks=text.count("Traceback (most recent call last)"),
        )
