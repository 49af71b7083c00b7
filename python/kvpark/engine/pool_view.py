"""Snapshots of the pool for ``GET /v1/pool/events``: who owns each page, the requests with their
sizes and parks, the host RAM parks hold, and what happened since the last snapshot.

Taken on the engine thread, the pool's one owner, after a turn of its loop: never while a step
changes it. :class:`PoolView` takes at most one snapshot per ``feed.interval`` and only while the
feed (the server's hub, server/pool_feed.py) says someone watches, so the engine's cost is the
same for one viewer or a hundred and nothing at all for none; an unchanged engine (same step,
same counts) is not snapshotted again. A snapshot is plain data, built here and never touched
again, which the hub hands to every viewer.

Page owners are numbers: a request's ``key`` (its arrival order, > 0), or :data:`FREE`,
:data:`CACHED` (a cached page: held by no sequence, kept for later prompts) or :data:`SHARED`
(held by more than one request, a common prefix found in the cache). Nothing of a prompt's text is
in a snapshot: ids and sizes only.

Cache evictions leave no trace in the pool, so they are found by comparing snapshots: a page
cached at the last snapshot whose hash key has since changed or gone was evicted (a page taken
back by a prompt keeps its key). A page evicted and registered under the same key again within
one interval is missed, and while nobody watches nothing is compared.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from kvpark._core import KvPool
from kvpark.sched.request import Request, RequestState

if TYPE_CHECKING:
    from kvpark.engine.llm_engine import LLMEngine

FREE = 0
CACHED = -1
SHARED = -2
Snapshot = dict[str, object]


class PoolFeed(Protocol):
    """Where snapshots go: the server's hub. ``watching`` and ``interval`` are read on the engine
    thread every turn, so they are plain attributes."""

    watching: bool  # someone is connected
    interval: float  # seconds between two snapshots at most
    # bumped whenever a viewer has come who needs a snapshot even of an unchanged engine (a
    # counter the engine only reads, so that no request is lost between two threads)
    wanted: int

    def publish(self, snapshot: Snapshot) -> None:
        """Hand a snapshot over (called on the engine thread)."""
        ...


class PoolView:
    """The engine thread's side of the pool view: when to snapshot, and the snapshots."""

    def __init__(self) -> None:
        self._due = 0.0  # monotonic time before which no snapshot is taken
        self._signature: tuple[int, ...] | None = None
        self._cached_keys: dict[int, int | None] | None = None  # None: nothing to compare with
        self._log_seen = 0  # the last timeline entry a snapshot carried
        self._wanted_seen = 0  # feed.wanted when the last snapshot was taken

    def tick(self, engine: LLMEngine, feed: PoolFeed | None) -> float | None:
        """After a turn of the engine loop: a snapshot to ``feed`` if one is due and wanted.
        Returns how long the loop may sleep before the next may be due (None: nobody watches)."""
        if feed is None or not feed.watching:
            self._cached_keys = None  # evictions meanwhile are not this view's to report
            self._signature = None
            return None
        now = time.monotonic()
        if now < self._due:
            return self._due - now
        signature = _signature(engine)
        wanted = feed.wanted
        if signature == self._signature and wanted == self._wanted_seen:
            return feed.interval
        self._signature, self._wanted_seen = signature, wanted
        self._due = now + feed.interval
        feed.publish(self.take(engine))
        return feed.interval

    def take(self, engine: LLMEngine) -> Snapshot:
        sched = engine.scheduler
        pool = sched.pool
        owners = [FREE] * pool.n_pages
        pages_of: dict[int, set[int]] = {}
        for seq_id, (req, _) in sched.by_seq.items():
            if not pool.has_sequence(seq_id):
                continue
            mine = pages_of.setdefault(req.key, set())
            for page in pool.page_table(seq_id):
                mine.add(page)
                owners[page] = req.key if owners[page] in (FREE, req.key) else SHARED
        cached = pool.eviction_order()
        for page in cached:
            owners[page] = CACHED
        evicted = self._evictions(pool, cached)
        if evicted:
            engine.pool_log.add("evict", pages=evicted)
        timeline = engine.pool_log.since(self._log_seen)
        self._log_seen = engine.pool_log.last
        return {
            "time": time.time(),
            "pool": _pool(engine),
            "preempt": _preempt(engine),
            "owners": owners,
            "requests": _requests(engine, pages_of),
            "counts": _counts(engine),
            "timeline": timeline,
        }

    def _evictions(self, pool: KvPool, cached: list[int]) -> int:
        keys = {page: pool.page_key(page) for page in cached}
        before, self._cached_keys = self._cached_keys, keys
        if before is None:
            return 0
        evicted = 0
        for page, key in before.items():
            now = keys[page] if page in keys else pool.page_key(page)
            evicted += now != key
        return evicted


def _signature(engine: LLMEngine) -> tuple[int, ...]:
    """What changes whenever the pool or the requests do: a step, an abort, an add."""
    s = engine.stats
    return (
        s.steps_total,
        s.kv_cells_used,
        s.kv_cells_cached,
        s.requests_waiting,
        len(engine.request_ids),
        engine.pool_log.last,
    )


def _pool(engine: LLMEngine) -> dict[str, object]:
    config = engine.config
    pool = engine.scheduler.pool
    return {
        "pages": pool.n_pages,
        "page_size": pool.page_size,
        "cells": pool.n_cells,
        "parallel": config.scheduler.parallel,
        "prefix_cache": config.pool.prefix_cache,
    }


def _preempt(engine: LLMEngine) -> dict[str, object]:
    preemption = engine.preemption
    if preemption is None:
        return {"enabled": False, "ram_held": 0, "ram_budget": 0}
    return {
        "enabled": True,
        "policy": engine.config.scheduler.preempt_policy,
        "ram_held": preemption.parking.held_bytes,  # what --preempt-ram bounds
        "ram_budget": preemption.budget_bytes,  # -1: no limit, 0: every park recomputes
    }


def _counts(engine: LLMEngine) -> dict[str, object]:
    s = engine.stats
    return {
        "cells_used": s.kv_cells_used,
        "cells_cached": s.kv_cells_cached,
        "running": s.requests_running,
        "waiting": s.requests_waiting,
        "parked": s.requests_preempted,
        "parks_swap": s.preemptions_total.get("swap", 0),
        "parks_recompute": s.preemptions_total.get("recompute", 0),
        "resumes": s.resumes_total,
        "rotations": s.rotations_total,
        "finished": s.requests_finished_total,
    }


def _requests(engine: LLMEngine, pages_of: dict[int, set[int]]) -> list[dict[str, object]]:
    """Every request the engine holds: waiting (with its place), then those in a slot."""
    sched = engine.scheduler
    out = [
        {**_sizes(engine, req, pages_of), "state": "waiting", "place": place}
        for place, req in enumerate(sched.waiting, 1)
    ]
    for req in sorted((*sched.running, *sched.transferring, *sched.parked), key=lambda r: r.key):
        record = _sizes(engine, req, pages_of)
        record["state"] = _state(req)
        if req.sequences:
            record["slot"] = sched.slot_of.get(req.sequences[0].seq_id)
        if req.state is RequestState.PARKED or req.park.mode is not None:
            record.update(_park(engine, req))
        out.append(record)
    return out


def _sizes(engine: LLMEngine, req: Request, pages_of: dict[int, set[int]]) -> dict[str, object]:
    cells = sum(engine.scheduler.cells.held(s.seq_id) for s in req.sequences)
    return {
        "key": req.key,
        "id": req.request_id,
        "n": req.params.n,
        "prompt_tokens": len(req.prompt_ids),
        "cached_tokens": req.cached_tokens,
        "output_tokens": sum(s.num_output for s in req.sequences),
        "cells": cells,
        "pages": len(pages_of.get(req.key, ())),
        "parks": req.parks,
        "recomputes": req.recomputes,
    }


def _state(req: Request) -> str:
    if req.state in (RequestState.PARKED, RequestState.PARKING, RequestState.RESTORING):
        return str(req.state.value)
    if req.park.replaying:
        return "replay"  # a recompute resume computing its tokens again
    prompt = any(s.num_computed < s.prompt_len for s in req.sequences)
    return "prefill" if prompt or not req.sequences else "decode"


def _park(engine: LLMEngine, req: Request) -> dict[str, object]:
    """A parked request's mode, how long it has been out, and the host bytes a swap holds."""
    mode = req.park.mode
    held = 0
    if mode == "swap" and engine.preemption is not None and req.sequences:
        held = engine.preemption.parking.state_bytes(req.sequences[0].num_computed)
    return {
        "mode": mode,
        "parked_s": round(max(0.0, time.monotonic() - req.park.parked_at), 3),
        "host_bytes": held,
    }
