"""The pool hub (server/pool_feed.py) without a server: pages as runs, deltas of what changed,
one encoding of each frame for every viewer, and a viewer that does not read bounded by skipping
to a fresh snapshot instead of buffering."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvpark.server.pool_feed import QUEUE_FRAMES, SKIPPED, PoolHub, Viewer, changed_runs, runs


class Engine:
    """What the hub asks of the engine: whom to feed, and whether it failed."""

    failure = None

    def __init__(self) -> None:
        self.fed: list[Any] = []

    def watch_pool(self, feed: Any) -> None:
        self.fed.append(feed)


def snapshot(owners: list[int], t: float, timeline: list[dict[str, Any]] | None = None) -> Any:
    return {
        "time": t,
        "pool": {"pages": len(owners), "page_size": 16},
        "preempt": {"enabled": True, "ram_held": 0, "ram_budget": -1},
        "owners": owners,
        "requests": [{"key": k, "id": f"r{k}"} for k in sorted({o for o in owners if o > 0})],
        "counts": {"running": len({o for o in owners if o > 0})},
        "timeline": timeline or [],
    }


def events(data: bytes) -> list[tuple[str, Any]]:
    """(event, body) of every frame, comments as ("comment", text)."""
    out: list[tuple[str, Any]] = []
    for block in data.decode().split("\n\n"):
        if block.startswith(":"):
            out.append(("comment", block[1:].strip()))
        elif block:
            name, data_line = block.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))))
    return out


def test_runs_cover_every_page_and_changed_runs_only_the_changes() -> None:
    owners = [0, 0, 3, 3, 3, -1, 4, 0]
    assert runs(owners) == [[0, 2, 0], [2, 3, 3], [5, 1, -1], [6, 1, 4], [7, 1, 0]]
    after = [0, 5, 5, 3, 3, -1, 0, 0]
    assert changed_runs(owners, after) == [[1, 2, 5], [6, 1, 0]]
    assert changed_runs(owners, owners) == []


def test_a_slow_viewer_skips_to_a_snapshot_instead_of_buffering() -> None:
    viewer = Viewer()
    viewer.offer(None, lambda: b"snapshot-1")
    for i in range(3 * QUEUE_FRAMES):
        viewer.offer(f"delta-{i}".encode(), lambda: b"snapshot-2")
        assert len(viewer.frames) <= QUEUE_FRAMES + 1
    assert viewer.skips == 3  # the first at the 8th delta, then every 7th
    frames = list(viewer.frames)
    assert frames[0] == SKIPPED and frames[1] == b"snapshot-2"  # a fresh picture, then on
    assert viewer.take() == b"".join(frames) and not viewer.frames and not viewer.ready.is_set()


def test_every_viewer_gets_the_same_frames_encoded_once() -> None:
    async def main() -> None:
        engine = Engine()
        hub = PoolHub(engine)  # type: ignore[arg-type]
        a, b = hub.join(), hub.join()
        assert hub.watching and engine.fed == [hub, hub] and hub.wanted == 2  # no picture yet
        hub._on_snapshot(snapshot([0, 0, 0, 0], 1.0))
        hub._on_snapshot(snapshot([2, 2, 0, 0], 1.25, [{"n": 1, "time": 1.2, "kind": "park"}]))
        hub._on_snapshot(snapshot([2, 2, 0, 0], 1.5))  # unchanged: no frame at all
        assert [f is g for f, g in zip(a.frames, b.frames, strict=True)] == [True, True]
        got = events(a.take())
        assert [name for name, _ in got] == ["snapshot", "delta"]
        first, delta = got[0][1], got[1][1]
        assert first["pages"] == [[0, 4, 0]] and first["interval"] == hub.interval
        assert delta["pages"] == [[0, 2, 2]] and delta["requests"] == [{"key": 2, "id": "r2"}]
        assert delta["timeline"] == [{"n": 1, "time": 1.2, "kind": "park"}]
        late = hub.join()  # a newcomer gets the current picture at once, timeline included
        (name, body), *_ = events(late.take())
        assert name == "snapshot" and body["pages"] == [[0, 2, 2], [2, 2, 0]]
        assert body["timeline"] == [{"n": 1, "time": 1.2, "kind": "park"}]
        for viewer in (a, b, late):
            hub.leave(viewer)
        assert hub.viewers == 0 and not hub.watching
        assert hub.snapshots == 3

    asyncio.run(main())


def test_a_viewer_that_never_reads_is_bounded_while_the_others_get_every_delta() -> None:
    async def main() -> None:
        hub = PoolHub(Engine())  # type: ignore[arg-type]
        reader, stuck = hub.join(), hub.join()
        received: list[tuple[str, Any]] = []
        for step in range(10 * QUEUE_FRAMES):
            owners = [step % 7 + 1] * 2 + [0, 0]
            hub._on_snapshot(snapshot(owners, 1.0 + step / 4))
            received += events(reader.take())
            assert len(stuck.frames) <= QUEUE_FRAMES + 1
        assert [name for name, _ in received].count("delta") == 10 * QUEUE_FRAMES - 1
        assert stuck.skips >= 8 and hub.skips == stuck.skips and reader.skips == 0
        hub.close()
        assert stuck.ready.is_set() and hub.closed and not hub.watching

    asyncio.run(main())
