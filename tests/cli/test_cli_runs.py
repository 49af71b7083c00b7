"""The command line as a process: ``python -m kvpark`` exits 2 on a bad flag and dispatches
``bench``, and one ``kvpark generate`` run loads the real default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_module(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    import kvpark

    package_root = str(Path(kvpark.__file__).resolve().parent.parent)
    environ = {**os.environ, "PYTHONPATH": package_root}
    return subprocess.run(
        [sys.executable, "-m", "kvpark", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
    )


def test_python_dash_m_kvpark_exits_2_on_a_bad_flag_and_dispatches_bench() -> None:
    bad = run_module("serve", "--kv-cells", "nope")
    assert bad.returncode == 2 and "--kv-cells" in bad.stderr
    bench = run_module("bench", "--help")
    assert bench.returncode == 0 and "bench" in bench.stdout


def test_generate_runs_the_default_model() -> None:
    result = run_module(
        "generate",
        "Hello",
        "The sky is",
        "--max-tokens",
        "3",
        "--json",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--kv-cells",
        "1024",
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["prompt"] for line in lines] == ["Hello", "The sky is"]
    assert all(line["error"] is None and line["texts"][0] for line in lines)
