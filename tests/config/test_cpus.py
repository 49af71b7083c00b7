"""The default thread count follows the process's affinity mask (kvpark/config/cpus.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from kvpark.config.cpus import usable_cpus

PINNED = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
from kvpark.config.cpus import usable_cpus
from kvpark.config.layers import ModelConfig, PoolConfig
from kvpark.runner.torch_runner import TorchRunner
r = TorchRunner(ModelConfig(), PoolConfig(kv_cells=256))
print(usable_cpus(), r.threads)
"""


def test_the_count_is_the_masks() -> None:
    assert usable_cpus() == len(os.sched_getaffinity(0))


def test_a_process_pinned_to_one_core_runs_one_thread() -> None:
    core = min(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", PINNED, str(core)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "1"]
