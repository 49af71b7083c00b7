"""Parks and resumes: what the Rust planner is shown each step, and how its actions are carried out.

Each step, before the batch is built (every request sits at a token boundary)::

    scheduler state ──snapshot──► _core.Planner.plan(pool, views, buffers, now) ──► actions
    actions: release_buffer | park(swap|recompute) | resume | rotate | fail
    park:    swap → Parking.swap_out (copy cells to the slot's host buffer), then free the cells;
             recompute, or a failed host allocation → free the cells; the tokens replay on resume
    resume:  fresh pages; swap → Parking.swap_in; recompute → its known tokens become prompt rows

A replay never draws from the request's generator: only a sequence's newest token is sampled, and
that draw would have happened without the park too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvpark._core import Action, Planner, RequestView
from kvpark.config import SchedulerConfig
from kvpark.env import Knobs
from kvpark.outputs import ErrorEvent, NoticeEvent, StreamEvent
from kvpark.parking import Parking
from kvpark.request import ParkMode, Request
from kvpark.scheduler import CONTEXT_ERROR, Scheduler
from kvpark.stats import EngineStats, Observations

log = logging.getLogger("kvpark.preempt")
MIB = 2**20


@dataclass
class Events:
    by_request: dict[str, list[StreamEvent]] = field(default_factory=dict)

    def add(self, req: Request, event: StreamEvent) -> None:
        self.by_request.setdefault(req.request_id, []).append(event)


class Preemption:
    def __init__(
        self,
        config: SchedulerConfig,
        scheduler: Scheduler,
        parking: Parking,
        stats: EngineStats,
        observations: Observations,
        knobs: Knobs,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.parking = parking
        self.stats = stats
        self.observations = observations
        self.knobs = knobs
        budget = -1 if config.preempt_ram_mib < 0 else config.preempt_ram_mib * MIB
        self.budget_bytes = budget
        # planner off: plan() parks nothing for pressure (resumes still come from it); a step
        # that fails to allocate asks choose_victims() instead
        self.planner = Planner(
            policy="cost" if config.preempt_policy == "cost" else "fcfs",
            ram_budget_bytes=budget,
            park_ahead=knobs.preempt_planner,
        )
        self.failed: list[Request] = []  # failed by a planner action; the engine releases them

    # ----------------------------------------------------------------- each step
    def before_step(self, events: Events) -> None:
        now = time.monotonic()
        actions = self.planner.plan(
            self.scheduler.pool, self._views(now), self.parking.capacities(), int(now * 1000)
        )
        self._apply(actions, events, now)
        if self.knobs.preempt_every > 0:  # after the plan: a forced park sits out at least one step
            self._park_on_schedule(events, now)
            self._refresh_gauges()

    def relieve(self, shortfall: int, events: Events) -> bool:
        """A step's decodes lack ``shortfall`` cells: park victims. False when nobody can go."""
        now = time.monotonic()
        actions = self.planner.choose_victims(
            self.scheduler.pool, self._views(now), self.parking.capacities(), shortfall
        )
        self._apply(actions, events, now)
        return any(a.kind == "park" for a in actions)

    def forget(self, req: Request) -> None:
        """A request left its slot (finished, failed, aborted): its park buffer goes back."""
        if req.park.buffer_slot is not None:
            self.parking.release(req.park.buffer_slot)
            req.park.buffer_slot = None
        self._refresh_gauges()

    # ----------------------------------------------------------------- snapshot
    def _views(self, now: float) -> list[RequestView]:
        sched = self.scheduler
        rows = sched.next_rows()
        views = []
        for req in sched.running:
            seqs = req.live_sequences
            views.append(
                self._view(
                    req,
                    now,
                    running=True,
                    seq_ids=[s.seq_id for s in seqs],
                    next_cells=[(s.seq_id, s.num_computed + rows.get(s.seq_id, 0)) for s in seqs],
                )
            )
        rows_budget = sched.config.max_batch_tokens
        for req in sched.parked:
            seq = req.sequences[0]
            # a swap comes back with its cells plus one step; a recompute with its whole replay,
            # so that it is not parked again halfway through it
            step = 1 if seq.pending_rows == 1 else min(seq.pending_rows, rows_budget)
            need = (
                len(seq.tokens) if req.park.mode is ParkMode.RECOMPUTE else seq.num_computed + step
            )
            views.append(
                self._view(req, now, running=False, seq_ids=[], next_cells=[], resume_cells=need)
            )
        return views

    def _view(
        self,
        req: Request,
        now: float,
        *,
        running: bool,
        seq_ids: list[int],
        next_cells: list[tuple[int, int]],
        resume_cells: int = 0,
    ) -> RequestView:
        seq = req.sequences[0]
        park = req.park
        return RequestView(
            id=req.key,
            arrival=req.key,
            state="running" if running else "parked",
            mode=None if running or park.mode is None else park.mode.value,
            seq_ids=seq_ids,
            next_cells=next_cells,
            resume_cells=resume_cells,
            state_bytes=self.parking.state_bytes(seq.num_computed),
            parks=park.parks,
            parked_at_ms=None if running else int(park.parked_at * 1000),
            resumed_at_ms=None if park.resumed_at is None else int(park.resumed_at * 1000),
            tokens_since_resume=seq.num_output - park.output_at_resume,
            family=len(req.sequences) > 1,
            refused=False,
            # a family member that finished gave its slot back; families never park anyway
            slot=next(
                (
                    self.scheduler.slot_of[s.seq_id]
                    for s in req.live_sequences
                    if s.seq_id in self.scheduler.slot_of
                ),
                0,
            ),
        )

    # ----------------------------------------------------------------- actions
    def _apply(self, actions: list[Action], events: Events, now: float) -> None:
        by_key = {r.key: r for r in (*self.scheduler.running, *self.scheduler.parked)}
        for action in actions:
            if action.kind == "release_buffer":
                freed = self.parking.release(action.slot or 0)
                log.info(
                    "%.1f MiB of idle parked RAM returned so that another slot can park",
                    freed / MIB,
                )
            elif action.kind == "park":
                self.park(
                    by_key[action.request or 0],
                    _mode(action.mode),
                    action.buffer_capacity,
                    events,
                    now,
                )
            elif action.kind == "resume":
                self.resume(by_key[action.request or 0], events, now)
            elif action.kind == "rotate":
                victim, head = by_key[action.request or 0], by_key[action.head or 0]
                waited = now - head.park.parked_at
                self.park(victim, _mode(action.mode), action.buffer_capacity, events, now)
                self.stats.rotations_total += 1
                log.info(
                    "rotated out request %s: a head parked %.1f s takes its turn",
                    victim.request_id,
                    waited,
                )
                self.resume(head, events, now)
            elif action.kind == "fail":
                req = by_key[action.request or 0]
                log.warning(
                    "request %s cannot fit the pool of %d cells even alone, failing it",
                    req.request_id,
                    self.scheduler.pool.n_cells,
                )
                self.failed.append(req)
                events.add(req, ErrorEvent(CONTEXT_ERROR, 500, "exceed_context_size_error"))
        self._refresh_gauges()

    def park(self, req: Request, mode: ParkMode, capacity: int, events: Events, now: float) -> None:
        seq = req.sequences[0]
        slot = self.scheduler.slot_of[seq.seq_id]
        n_cells = seq.num_computed
        started = time.perf_counter()
        if mode is ParkMode.SWAP:
            cells = self.scheduler.pool.slot_mapping(seq.seq_id, 0, n_cells)
            if self.parking.swap_out(slot, cells, capacity) is None:
                mode = ParkMode.RECOMPUTE  # the budget grants permission, not an allocation
            else:
                req.park.buffer_slot = slot
        self.scheduler.park(req, mode)
        copy_s = time.perf_counter() - started
        req.park.parks += 1
        req.park.mode = mode
        req.park.parked_at = now
        self.stats.preemptions_total[mode.value] += 1
        if mode is ParkMode.RECOMPUTE:
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
        events.add(req, NoticeEvent("preempted"))

    def resume(self, req: Request, events: Events, now: float) -> None:
        seq = req.sequences[0]
        mode = req.park.mode
        started = time.perf_counter()
        cells = self.scheduler.resume(req)
        if mode is ParkMode.SWAP:
            self.parking.swap_in(self.scheduler.slot_of[seq.seq_id], cells)
            self.observations.add("transfer_duration_seconds", time.perf_counter() - started)
        else:
            self.stats.recomputed_tokens_total += req.park.dropped
        self.observations.add("park_duration_seconds", now - req.park.parked_at)
        self.stats.resumes_total += 1
        req.park.mode = None
        req.park.resumed_at = now
        req.park.output_at_resume = seq.num_output
        log.info(
            "resumed request %s after %.2f s: %d cells back, kv %d/%d, parks %d",
            req.request_id,
            now - req.park.parked_at,
            len(cells),
            self.scheduler.pool.cells_used(),
            self.scheduler.pool.n_cells,
            req.parks,
        )
        events.add(req, NoticeEvent("resumed"))
        if mode is ParkMode.RECOMPUTE:
            events.add(req, NoticeEvent("recomputed"))

    def _park_on_schedule(self, events: Events, now: float) -> None:
        """KVPARK_PREEMPT_EVERY=N: park every generating request each N tokens, pressure or not."""
        n = self.knobs.preempt_every
        for req in list(self.scheduler.running):
            seq = req.sequences[0]
            if (
                len(req.sequences) == 1
                and seq.num_output >= (req.parks + 1) * n
                and seq.pending_rows == 1
            ):
                need = self.parking.state_bytes(seq.num_computed)
                fits = self.budget_bytes < 0 or self.parking.held_bytes + need <= self.budget_bytes
                mode = ParkMode.SWAP if fits and self.budget_bytes != 0 else ParkMode.RECOMPUTE
                self.park(req, mode, need, events, now)

    def _refresh_gauges(self) -> None:
        self.stats.requests_preempted = len(self.scheduler.parked)
        self.stats.preempt_ram_bytes = self.parking.held_bytes


def _mode(name: str | None) -> ParkMode:
    return ParkMode.RECOMPUTE if name == "recompute" else ParkMode.SWAP
