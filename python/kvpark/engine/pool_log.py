"""The pool's recent history for ``GET /v1/pool/events``: parks, resumes and rotations as they
happen, and cache evictions as the snapshots find them (engine/pool_view.py).

Always on, because a viewer who connects wants the last minutes, not only what comes after: it
costs one entry per park notice (parks are rare next to tokens) and a counter comparison per step.
Bounded twice, by :data:`MAX_ENTRIES` and by :data:`KEEP_S`, so a server that parks all day holds
the same few kilobytes. Engine thread only; the snapshot copies what it hands out.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace

from kvpark.sched.request import Request

MAX_ENTRIES = 512
KEEP_S = 600.0  # ten minutes: the pool view draws the last five


@dataclass(frozen=True)
class LogEntry:
    """One thing that happened to the pool. ``n`` counts from 1 in order; ``time`` is wall-clock
    seconds (the browser sets it against the snapshot's own ``time``)."""

    n: int
    time: float
    kind: str  # park | resume | rotation | evict
    request: str | None = None  # the engine request id (never its text)
    key: int | None = None  # the request's number in the pool view (its arrival order)
    mode: str | None = None  # swap | recompute, for a park or a resume
    cells: int = 0  # a park: the cells it held; a resume: the cells it came back with
    pages: int = 0  # an eviction: the cached pages evicted since the last snapshot
    count: int = 0  # a rotation: how many the step made

    def as_json(self) -> dict[str, object]:
        # the fields that say something: no nulls, no zero counts
        return {k: v for k, v in asdict(self).items() if v is not None and v != 0}


class PoolLog:
    """Recent pool events, oldest first."""

    def __init__(self, max_entries: int = MAX_ENTRIES, keep_s: float = KEEP_S) -> None:
        self._entries: deque[LogEntry] = deque(maxlen=max_entries)
        self._keep_s = keep_s
        self._count = 0
        self._rotations = 0  # the engine's rotation counter when last looked at

    def add(self, kind: str, **fields: object) -> None:
        self._count += 1
        now = time.time()
        self._entries.append(LogEntry(self._count, now, kind, **fields))  # type: ignore[arg-type]
        while self._entries and self._entries[0].time < now - self._keep_s:
            self._entries.popleft()

    def note_step(
        self,
        notices: Iterable[tuple[str, str]],
        requests: Mapping[str, Request],
        rotations_total: int,
    ) -> None:
        """A step's park notices (request id, kind) in order, and its rotations (the engine's
        counter: a rotation is a park and a resume, which the notices give one by one)."""
        for request_id, kind in notices:
            req = requests.get(request_id)
            key = req.key if req is not None else None
            # a request the same step finished or failed has left: its entry has no sizes
            seq = req.sequences[0] if req is not None and req.sequences else None
            if kind == "preempted":
                mode = req.park.mode if req is not None else None
                # a recompute park has zeroed what it computed: what it dropped says the size
                cells = 0 if seq is None or req is None else seq.num_computed
                if req is not None and mode == "recompute":
                    cells = req.park.dropped
                self.add("park", request=request_id, key=key, mode=mode, cells=cells)
            elif kind == "resumed":
                cells = seq.num_computed if seq is not None else 0
                self.add("resume", request=request_id, key=key, mode="swap", cells=cells)
            elif kind == "recomputed" and self._entries and self._entries[-1].kind == "resume":
                # ": recomputed" follows its ": resumed" at once: that resume replays its tokens
                self._entries.append(replace(self._entries.pop(), mode="recompute"))
        rotated = rotations_total - self._rotations
        self._rotations = rotations_total
        if rotated > 0:
            self.add("rotation", count=rotated)

    def since(self, n: int) -> list[dict[str, object]]:
        """The entries after entry ``n`` (0: all kept), as JSON objects."""
        return [e.as_json() for e in self._entries if e.n > n]

    @property
    def last(self) -> int:
        return self._count
