"""``kvpark bench`` (main.py): the load generator (client, workloads, scenarios, reports, pressure)
and the published benchmarks' suites (``suites/``), which start the servers they measure as
subprocesses, with the llama.cpp peer's build (``llama_build.py``). Imports nothing else of kvpark
but config: it drives any OpenAI-compatible server over HTTP.
"""

from __future__ import annotations

from kvpark.bench.client import Target
from kvpark.bench.compare import run
from kvpark.bench.main import main
from kvpark.bench.options import BenchOptions
from kvpark.bench.report import RunResult

__all__ = ["BenchOptions", "RunResult", "Target", "main", "run"]
