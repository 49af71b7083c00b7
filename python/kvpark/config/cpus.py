"""How many CPUs this process may run on: the default thread count of every CPU path.

The CPUs of the process's affinity mask, not the machine's: under `taskset`, a container's cpuset
or a test worker pinned to one core, threads beyond the mask only take turns on the same cores,
and the block kernels' helpers, which spin between products, then steal the caller's core.
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may be scheduled on (at least 1)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
