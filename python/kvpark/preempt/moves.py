"""Carrying out one park or resume, including the copy still in flight after it.

::

    running ──park──► parking ──copy out landed: cells freed──► parked
       ▲                                                           │
       └──── ": resumed" ◄── copy back landed ◄── restoring ◄──resume

A swap whose copy is still in flight when ``Parking.swap_out`` / ``swap_in`` return (asynchronous
transfers, ``preempt/copies.py``) waits in ``parking`` or ``restoring``
(``scheduler.transferring``): it takes no part in steps, keeps its cells, and ``land`` (called once
per step, before planning) moves it on once ``Parking.landed`` says the copy is done.
``: preempted`` goes out when the copy out starts, ``: resumed`` when the copy back has landed. With
synchronous transfers both copies have landed on return and the request goes straight to ``parked``
/ ``running``. A request that leaves during a copy (abort, shutdown) waits for it first
(``settle``), so its cells and buffer are never freed under a copy.
"""

from __future__ import annotations

import logging
import time

from kvpark._core import PoolFullError
from kvpark.preempt.buffers import Parking
from kvpark.preempt.reports import LatencySamples, ParkCounters, ParkNotices
from kvpark.sched.request import ParkMode, Request, RequestState
from kvpark.sched.scheduler import Scheduler

log = logging.getLogger("kvpark.preempt")
MIB = 2**20


class ParkMoves:
    def __init__(
        self,
        scheduler: Scheduler,
        parking: Parking,
        stats: ParkCounters,
        observations: LatencySamples,
    ) -> None:
        self.scheduler = scheduler
        self.parking = parking
        self.stats = stats
        self.observations = observations

    def parks_in_flight(self) -> bool:
        return any(r.state is RequestState.PARKING for r in self.scheduler.transferring)

    def land(self, events: ParkNotices, wait_parks: bool = False) -> None:
        """Advance the requests whose copy has landed (polled once per step, before planning): a
        park frees its cells, a restore goes back into the steps and says so. ``wait_parks``:
        block until every park copy has landed (restores are left alone)."""
        for req in list(self.scheduler.transferring):
            slot = req.park.buffer_slot
            assert slot is not None, "only a swap copies"
            parking = req.state is RequestState.PARKING
            if wait_parks:
                if not parking:
                    continue
                self.parking.wait(slot)
            elif not self.parking.landed(slot):
                continue
            if parking:
                self._park_landed(req)
            else:
                self._resumed(req, events, time.monotonic())

    def settle(self, req: Request) -> None:
        """Before a request leaves (abort, shutdown): wait for a copy of its cells in flight."""
        if req.park.buffer_slot is not None:
            self.parking.wait(req.park.buffer_slot)

    def park(
        self, req: Request, mode: ParkMode, capacity: int, events: ParkNotices, now: float
    ) -> None:
        seq = req.sequences[0]
        slot = self.scheduler.slot_of[seq.seq_id]
        # its cells from the first it holds: those behind a sliding window left the pool already
        first = self.scheduler.pool.released_cells(seq.seq_id)
        n_cells = seq.num_computed - first
        req.park.copy_started = time.perf_counter()
        if mode == "swap":
            cells = self.scheduler.cells.park_cells(seq.seq_id, first, seq.num_computed)
            if self.parking.swap_out(slot, cells, capacity, n_cells) is None:
                mode = "recompute"  # the budget grants permission, not an allocation
            else:
                req.park.buffer_slot = slot
        req.park.parks += 1
        req.park.mode = mode
        req.park.parked_at = now
        self.stats.preemptions_total[mode] += 1
        events.notice(req.request_id, "preempted")  # it takes no part in decoding from now on
        if mode == "swap" and self.parking.in_flight(slot):
            self.scheduler.hold(req, RequestState.PARKING)  # its cells go when the copy lands
            log.info(
                "preempted request %s by swap: park of %d cells (%.1f MiB) issued in %.2f ms",
                req.request_id,
                n_cells,
                self.parking.state_bytes(n_cells) / MIB,
                (time.perf_counter() - req.park.copy_started) * 1000,
            )
            return
        if mode == "recompute":
            self.scheduler.park(req, mode)
            req.park.recomputes += 1
            log.info(
                "preempted request %s by recompute: %d cells dropped, %d tokens to re-prefill"
                ", kv %d/%d, parks %d",
                req.request_id,
                n_cells,
                len(seq.tokens),
                self.scheduler.pool.cells_used(),
                self.scheduler.pool.n_cells,
                req.parks,
            )
        else:
            self._park_landed(req)

    def _park_landed(self, req: Request) -> None:
        """A swap's copy out has landed: free its cells."""
        n_cells = req.sequences[0].num_computed
        self.scheduler.park(req, "swap")
        copy_s = time.perf_counter() - req.park.copy_started
        self.observations.add("transfer_duration_seconds", copy_s)
        log.info(
            "preempted request %s by swap: %d cells released in %.2f ms, %.1f MiB parked"
            ", kv %d/%d, parks %d",
            req.request_id,
            n_cells,
            copy_s * 1000,
            self.parking.state_bytes(n_cells) / MIB,
            self.scheduler.pool.cells_used(),
            self.scheduler.pool.n_cells,
            req.parks,
        )

    def resume(self, req: Request, events: ParkNotices, now: float) -> None:
        seq = req.sequences[0]
        req.park.copy_started = time.perf_counter()
        reuse = self.parking.restores_from_cell
        try:
            cells, cached = self.scheduler.resume(req, reuse)
        except PoolFullError:  # a park still copying holds the room this resume was planned into
            self.land(events, wait_parks=True)
            try:
                cells, cached = self.scheduler.resume(req, reuse)
            except PoolFullError:
                log.warning("request %s stays parked: its cells do not fit", req.request_id)
                return
        if req.park.mode == "swap":
            slot = self.scheduler.slot_of[seq.seq_id]
            self.parking.swap_in(slot, cells, cached)  # its cached prefix is not copied
            if self.parking.in_flight(slot):  # ": resumed" goes out when the copy lands
                self.scheduler.hold(req, RequestState.RESTORING)
                return
        self._resumed(req, events, now)

    def _resumed(self, req: Request, events: ParkNotices, now: float) -> None:
        """It can be scheduled again: the copy back has landed, or there was none to wait for."""
        seq = req.sequences[0]
        mode = req.park.mode
        if req.state is RequestState.RESTORING:
            self.scheduler.land(req)
        self.scheduler.register_restored(req)
        if mode == "swap":
            copy_s = time.perf_counter() - req.park.copy_started
            self.observations.add("transfer_duration_seconds", copy_s)
        else:
            self.stats.recomputed_tokens_total += req.park.dropped
        self.observations.add("park_duration_seconds", now - req.park.parked_at)
        self.stats.resumes_total += 1
        req.park.mode = None
        req.park.resumed_at = now
        req.park.replaying = mode == "recompute"
        req.park.output_at_resume = seq.num_output
        log.info(
            "resumed request %s after %.2f s: %d cells back, kv %d/%d, parks %d",
            req.request_id,
            now - req.park.parked_at,
            seq.num_computed,
            self.scheduler.pool.cells_used(),
            self.scheduler.pool.n_cells,
            req.parks,
        )
        events.notice(req.request_id, "resumed")
        if mode == "recompute":
            events.notice(req.request_id, "recomputed")
