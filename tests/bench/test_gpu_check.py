"""The GPU check cannot rot: its CPU smoke mode (a tiny model, no CUDA) runs end to end here, from
the installed package in a folder outside the checkout; the checkout's ``bench/gpu_check.py``
calls the same ``main``.

The real run needs a GPU: ``kvpark bench --scenario gpu-check --out bench-results/gpu-check.json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

CALLER = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
MODULE = "kvpark.bench.in_process.gpu_check"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", MODULE, *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_the_checkouts_caller_runs_the_module() -> None:
    done = subprocess.run(
        [sys.executable, str(CALLER), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "--smoke" in done.stdout


def test_the_smoke_run_measures_everything_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    done = run("--smoke", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    assert res["smoke"] is True and res["device"] == "cpu" and "gpu_tests" not in res
    assert sorted(res["decode"]) == ["1", "2", "4"]
    for d in res["decode"].values():
        assert d["step_ms"] > 0 and d["roofline_ms"] > 0 and d["ratio"] > 0
    assert res["prefill_tok_s"] > 0 and res["bandwidth_gbs"] > 0
    assert res["park"]["sync_park_ms_per_mib"] > 0 and res["park"]["sync_resume_ms_per_mib"] > 0
    assert "async_park_ms_per_mib" not in res["park"]  # no asynchronous copies on CPU
    assert res["gap_sync"]["step_ms"] > 0 and res["gap_async"]["step_ms"] > 0
    assert res["exact"]["batch"] == 4 and res["exact"]["ratio"] > 0
    assert len(res["goals"]) == 2
    for name, met in res["goals"].items():
        assert f"GOAL {name}" in done.stdout and ("MET" if met else "NOT MET") in done.stdout


def test_help_works_and_a_real_run_needs_cuda() -> None:
    helped = run("--help")
    assert helped.returncode == 0 and "--smoke" in helped.stdout
    if not torch.cuda.is_available():
        refused = run("--no-tests")
        assert refused.returncode == 2 and "no CUDA device here" in refused.stderr
