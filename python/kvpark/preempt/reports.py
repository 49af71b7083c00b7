"""What parks and resumes report, and where to: the engine hands preemption objects that meet these
protocols (``engine.outputs.Events``, ``engine.stats.EngineStats`` and ``Observations``), so this
layer names no engine type.
"""

from __future__ import annotations

from typing import Protocol


class ParkNotices(Protocol):
    """A step's events, as far as parking adds to them."""

    def notice(self, request_id: str, kind: str) -> None:
        """A park notice: ``preempted``, ``resumed`` or ``recomputed``."""
        ...

    def fail(self, request_id: str, message: str, kind: str = "server_error") -> None:
        """The request failed after it was accepted (HTTP 500)."""
        ...


class ParkCounters(Protocol):
    """The counters parking grows (``/metrics``)."""

    preemptions_total: dict[str, int]  # by park mode
    resumes_total: int
    rotations_total: int
    recomputed_tokens_total: int


class LatencySamples(Protocol):
    """Where a duration goes to be observed: ``park_duration_seconds``,
    ``transfer_duration_seconds``."""

    def add(self, key: str, value: float) -> None: ...
