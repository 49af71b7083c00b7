"""The hub behind ``GET /v1/pool/events``: one subscription to the engine's pool snapshots,
shared by every viewer, and each viewer's bounded queue of frames.

::

    engine thread ── snapshot (≤ 1 per INTERVAL_S, only while someone watches) ──► PoolHub
        PoolHub: the delta against the last snapshot, encoded once ──► every Viewer's queue
        Viewer: at most QUEUE_FRAMES frames; one more and it skips to a full snapshot instead

The engine's cost is one snapshot per interval whatever the number of viewers (engine/pool_view.py
takes it; :class:`PoolHub` is its ``PoolFeed``); each frame is encoded once, and a viewer costs
an append to its queue. A viewer that reads slowly never makes anything buffer without bound:
past :data:`QUEUE_FRAMES` its queue is replaced by one full snapshot (``: skipped`` then the
``snapshot`` event), and one that reads nothing at all is dropped by ``--stall-timeout``
(server/pool_events.py).

Frames (docs/web.md has the fields): ``event: snapshot`` with the whole picture, first on every
connection and after a skip, then ``event: delta`` with what changed: the pages whose owner
changed, as runs ``[first_page, count, owner]``, and the request list, RAM and counts when they
changed, and the new timeline entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from kvpark.engine.async_engine import AsyncEngine

log = logging.getLogger("kvpark.server")
INTERVAL_S = 0.25  # at most four snapshots a second: a pool view, not a profiler
QUEUE_FRAMES = 8  # two seconds of deltas a viewer may have unsent before it skips ahead
TIMELINE_S = 300.0  # a snapshot carries the last five minutes of the timeline
TIMELINE_MAX = 512
Runs = list[list[int]]  # [first page, count, owner]
JSON = dict[str, object]


def runs(owners: list[int]) -> Runs:
    """The owners as runs of equal neighbours (a pool hands pages out in runs, so few)."""
    out: Runs = []
    for page, owner in enumerate(owners):
        if out and out[-1][2] == owner and out[-1][0] + out[-1][1] == page:
            out[-1][1] += 1
        else:
            out.append([page, 1, owner])
    return out


def changed_runs(before: list[int], after: list[int]) -> Runs:
    """Runs covering only the pages whose owner differs between two snapshots."""
    out: Runs = []
    for page, (old, new) in enumerate(zip(before, after, strict=True)):
        if old == new:
            continue
        if out and out[-1][2] == new and out[-1][0] + out[-1][1] == page:
            out[-1][1] += 1
        else:
            out.append([page, 1, new])
    return out


def frame(event: str, body: JSON) -> bytes:
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event}\ndata: {data}\n\n".encode()


SKIPPED = b": skipped\n\n"  # a slow viewer's queue was dropped; a snapshot follows


class Viewer:
    """One connection's frames not yet written, bounded by :data:`QUEUE_FRAMES`."""

    def __init__(self) -> None:
        self.frames: deque[bytes] = deque()
        self.needs_snapshot = True  # its first frame, or the next after a skip
        self.skips = 0
        self.ready = asyncio.Event()

    def offer(self, delta: bytes | None, snapshot: Callable[[], bytes]) -> None:
        if not self.needs_snapshot and len(self.frames) >= QUEUE_FRAMES:
            self.frames.clear()  # it reads slower than the pool changes: skip to now
            self.frames.append(SKIPPED)
            self.skips += 1
            self.needs_snapshot = True
        if self.needs_snapshot:
            self.frames.append(snapshot())
            self.needs_snapshot = False
        elif delta is not None:
            self.frames.append(delta)
        else:
            return
        self.ready.set()

    def take(self) -> bytes:
        """Every frame queued, as one write."""
        out = b"".join(self.frames)
        self.frames.clear()
        self.ready.clear()
        return out


class PoolHub:
    """The engine's ``PoolFeed`` (engine/pool_view.py) and the viewers' fan-out."""

    interval = INTERVAL_S

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.watching = False  # read by the engine thread: any viewer connected
        self.closed = False
        self.wanted = 0  # bumped for a viewer that needs a snapshot now (read by the engine)
        self._viewers: set[Viewer] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state: JSON | None = None  # the last snapshot, owners as a list
        self._timeline: deque[JSON] = deque(maxlen=TIMELINE_MAX)
        self.snapshots = 0  # taken by the engine for this hub (kvpark_pool_snapshots_total)
        self.skips = 0  # times a slow viewer's queue was dropped (kvpark_pool_viewer_skips_total)

    @property
    def viewers(self) -> int:
        return len(self._viewers)

    # -- engine thread --------------------------------------------------------------------------

    def publish(self, snapshot: JSON) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed: the server is gone
            loop.call_soon_threadsafe(self._on_snapshot, snapshot)

    # -- event loop -----------------------------------------------------------------------------

    def join(self) -> Viewer:
        """A new viewer: the current picture at once if there is one, else the next snapshot,
        which the engine is asked for now."""
        self._loop = asyncio.get_running_loop()
        viewer = Viewer()
        self._viewers.add(viewer)
        if self._state is not None:
            viewer.offer(None, self._snapshot_frame)
        else:
            self.wanted += 1
        self.watching = True
        self.engine.watch_pool(self)
        return viewer

    def leave(self, viewer: Viewer) -> None:
        self._viewers.discard(viewer)
        if not self._viewers:
            self.watching = False
            self._state = None  # stale from now on: the next viewer waits for a fresh one

    def close(self) -> None:
        """Shutdown: every viewer's stream ends."""
        self.closed = True
        self.watching = False
        for viewer in self._viewers:
            viewer.ready.set()

    def _on_snapshot(self, snapshot: JSON) -> None:
        self.snapshots += 1
        if not self._viewers:
            return  # the last viewer left while this one was on its way
        previous = self._state
        entries = snapshot.get("timeline")
        if isinstance(entries, list):
            self._timeline.extend(entries)
        self._state = snapshot
        delta = None if previous is None else _delta(previous, snapshot)
        delta_frame = None if delta is None else frame("delta", delta)
        encoded: list[bytes] = []

        def snapshot_frame() -> bytes:  # encoded once per snapshot, and only if someone needs it
            if not encoded:
                encoded.append(self._snapshot_frame())
            return encoded[0]

        for viewer in self._viewers:
            skips = viewer.skips
            viewer.offer(delta_frame, snapshot_frame)
            self.skips += viewer.skips - skips

    def _snapshot_frame(self) -> bytes:
        state = self._state
        assert state is not None
        now = state["time"]
        assert isinstance(now, float)
        timeline = [e for e in self._timeline if _age(e, now) <= TIMELINE_S]
        body = {k: v for k, v in state.items() if k not in ("owners", "timeline")}
        owners = state["owners"]
        assert isinstance(owners, list)
        return frame(
            "snapshot",
            {**body, "interval": self.interval, "pages": runs(owners), "timeline": timeline},
        )


def _delta(before: JSON, after: JSON) -> JSON | None:
    """What changed between two snapshots; None if nothing did."""
    old, new = before["owners"], after["owners"]
    assert isinstance(old, list) and isinstance(new, list)
    delta: JSON = {}
    pages = changed_runs(old, new)
    if pages:
        delta["pages"] = pages
    for key in ("requests", "preempt", "counts"):
        if after[key] != before[key]:
            delta[key] = after[key]
    if after.get("timeline"):
        delta["timeline"] = after["timeline"]
    if not delta:
        return None
    delta["time"] = after["time"]
    return delta


def _age(entry: JSON, now: float) -> float:
    at = entry.get("time")
    return now - at if isinstance(at, float) else 0.0


class PoolCollector:
    """``/metrics``: the viewers, the engine's snapshots and the slow viewers' skips, read at
    scrape time."""

    def __init__(self, hub: PoolHub) -> None:
        self.hub = hub

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvpark_pool_viewers", "Connections to GET /v1/pool/events", value=self.hub.viewers
        )
        yield CounterMetricFamily(
            "kvpark_pool_snapshots",
            "Pool snapshots the engine took for GET /v1/pool/events (one per interval at most, "
            "whatever the number of viewers)",
            value=self.hub.snapshots,
        )
        yield CounterMetricFamily(
            "kvpark_pool_viewer_skips",
            "Times a pool viewer that read too slowly skipped to a fresh snapshot",
            value=self.hub.skips,
        )
