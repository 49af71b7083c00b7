"""The load generator (``kvpark bench``, main.py): client, workloads, scenarios, reports, pressure.
Imports nothing else of kvpark but config: it drives any OpenAI-compatible server over HTTP.
"""

from __future__ import annotations

from kvpark.bench.client import Target
from kvpark.bench.main import main, run
from kvpark.bench.report import RunResult
from kvpark.bench.scenarios import BenchOptions

__all__ = ["BenchOptions", "RunResult", "Target", "main", "run"]
