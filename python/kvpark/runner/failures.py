"""``RunnerFailed``: what a runner raises when it can run nothing more, so that the engine stops
rather than failing one step and going on (engine/step_failures.py)."""

from __future__ import annotations


class RunnerFailed(Exception):
    """The runner can run nothing more (a rank of a tensor-parallel group is gone): the engine
    fails every request and stops, as for any engine failure. Neither a RuntimeError nor a
    MemoryError, so that no path that falls back on those (a park's host buffer and save) takes
    it for a small failure."""
