"""Parks and resumes: what the Rust planner is shown each step, and how its actions are carried out.

Each step, before the batch is built (every request sits at a token boundary)::

    scheduler state ──snapshot──► _core.Planner.plan(pool, views, buffers, now) ──► actions
    actions: release_buffer | park(swap|recompute) | resume | rotate | fail
    park:    swap → Parking.swap_out (copy cells to the slot's host buffer), then free the cells;
             recompute, or a failed host allocation → free the cells; the tokens replay on resume
    resume:  fresh pages; swap → Parking.swap_in; recompute → its known tokens become prompt rows

``moves.py`` carries each park and resume out, through the in-flight states ``parking`` and
``restoring`` when the copy is asynchronous; this file decides them and lands the copies first.

A replay never draws from the request's generator: only a sequence's newest token is sampled, and
that draw would have happened without the park too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from kvpark._core import Action, Planner, RequestView
from kvpark.config.env import Knobs
from kvpark.config.layers import DEFAULT_PREEMPT_POLICY, PREEMPT_POLICIES, SchedulerConfig
from kvpark.preempt.buffers import Parking
from kvpark.preempt.moves import ParkMoves
from kvpark.preempt.reports import LatencySamples, ParkCounters, ParkNotices
from kvpark.sched.plan import StepPlan
from kvpark.sched.request import ParkMode, Request, RequestState
from kvpark.sched.scheduler import CONTEXT_ERROR, Scheduler, StepOutcome, rows_wanted

log = logging.getLogger("kvpark.preempt")
MIB = 2**20
MARGIN_CELLS = 8  # headroom the planner keeps free (rounded up to a page)
# An async park frees its cells only when its copy lands, so it must start early enough to leave
# room for the steps in between: this many rows of runway per running request.
ASYNC_RUNWAY_STEPS = 8
MAX_RELIEF_ROUNDS = 8  # parks tried when a step's decodes do not fit (one victim per round)


class Preemption:
    def __init__(
        self,
        config: SchedulerConfig,
        scheduler: Scheduler,
        parking: Parking,
        stats: ParkCounters,
        observations: LatencySamples,
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
        self._planners: dict[int, Planner] = {}  # by margin; see _planner()
        self.moves = ParkMoves(scheduler, parking, stats, observations)
        self.failed: list[Request] = []  # failed by a planner action; the engine releases them

    # ----------------------------------------------------------------- each step
    @property
    def asynchronous(self) -> bool:
        return self.parking.asynchronous

    def fit_step(
        self, events: ParkNotices, drop: Callable[[Request], None]
    ) -> tuple[StepPlan, StepOutcome]:
        """Make this step fit: the one owner of the schedule <-> relieve rounds. Parks and resumes
        first (every request is at a token boundary), then the batch; while its decodes lack
        cells, park a victim (one a round, at most ``MAX_RELIEF_ROUNDS``) and build it again; if
        nobody can go, the batch in which whoever lacks a cell waits (``Scheduler.schedule``).
        Each round computes the next rows once, for the planner's views and the scheduler alike.
        ``drop`` releases a request the planner failed (the engine owns its per-request
        state)."""
        self._before_step(events)
        for req in self.failed:
            drop(req)
        self.failed.clear()
        rows = self.scheduler.next_rows()
        plan, outcome = self.scheduler.schedule(report_shortfall=True, rows=rows)
        for _ in range(MAX_RELIEF_ROUNDS):
            if outcome.shortfall == 0 or not self._relieve(outcome.shortfall, events, rows):
                break
            rows = self.scheduler.next_rows()
            plan, outcome = self.scheduler.schedule(report_shortfall=True, rows=rows)
        if outcome.shortfall > 0:  # nobody can be parked: who lacks a cell waits (or fails)
            plan, outcome = self.scheduler.schedule(rows=rows)
        return plan, outcome

    def _before_step(self, events: ParkNotices) -> None:
        self.moves.land(events)
        now = time.monotonic()
        actions = self._plan(now)
        if self.moves.parks_in_flight() and any(a.kind in ("park", "rotate") for a in actions):
            # the pool still counts the cells of a park in flight, which the planner cannot know
            # are leaving: wait for them instead of parking someone else on top
            self.moves.land(events, wait_parks=True)
            actions = self._plan(now)
        self._apply(actions, events, now)
        if self.knobs.preempt_every > 0:  # after the plan: a forced park sits out at least one step
            self._park_on_schedule(events, now)

    def _relieve(self, shortfall: int, events: ParkNotices, rows: dict[int, int]) -> bool:
        """A step's decodes lack ``shortfall`` cells: park victims. False when nobody can go."""
        if self.moves.parks_in_flight():  # their cells are what the step lacks
            self.moves.land(events, wait_parks=True)
            return True
        now = time.monotonic()
        views = planner_views(self.scheduler, self.parking, now, rows)
        actions = self._planner().choose_victims(
            self.scheduler.pool, views, self.parking.capacities(), shortfall
        )
        self._apply(actions, events, now)
        self.moves.land(events, wait_parks=True)  # this step needs the room now
        return any(a.kind == "park" for a in actions)

    def settle(self, req: Request) -> None:
        """Before a request leaves (abort, shutdown): wait for a copy of its cells in flight."""
        self.moves.settle(req)

    def forget(self, req: Request) -> None:
        """A request left its slot (finished, failed, aborted): its park buffer goes back."""
        if req.park.buffer_slot is not None:
            self.parking.release(req.park.buffer_slot)
            req.park.buffer_slot = None

    # ----------------------------------------------------------------- planning
    def _planner(self) -> Planner:
        margin = MARGIN_CELLS
        if self.parking.asynchronous:
            margin += ASYNC_RUNWAY_STEPS * (
                len(self.scheduler.running) + len(self.scheduler.transferring)
            )
        planner = self._planners.get(margin)
        if planner is None:
            # a name the planner does not know gets the default, as it always has
            chosen = self.config.preempt_policy
            policy = chosen if chosen in PREEMPT_POLICIES else DEFAULT_PREEMPT_POLICY
            # planner off: plan() parks nothing for pressure (resumes still come from it); a step
            # that fails to allocate asks choose_victims() instead
            planner = self._planners[margin] = Planner(
                policy=policy,
                margin_cells=margin,
                ram_budget_bytes=self.budget_bytes,
                park_ahead=self.knobs.preempt_planner,
            )
        return planner

    def _plan(self, now: float) -> list[Action]:
        views = planner_views(self.scheduler, self.parking, now, self.scheduler.next_rows())
        return self._planner().plan(
            self.scheduler.pool, views, self.parking.capacities(), int(now * 1000)
        )

    # ----------------------------------------------------------------- actions
    def _apply(self, actions: list[Action], events: ParkNotices, now: float) -> None:
        by_key = {r.key: r for r in (*self.scheduler.running, *self.scheduler.parked)}
        for action in actions:
            if action.kind == "release_buffer":
                freed = self.parking.release(action.slot or 0)
                log.info(
                    "%.1f MiB of idle parked RAM returned so that another slot can park",
                    freed / MIB,
                )
            elif action.kind == "park":
                self.moves.park(
                    by_key[action.request or 0],
                    _mode(action.mode),
                    action.buffer_capacity,
                    events,
                    now,
                )
            elif action.kind == "resume":
                self.moves.resume(by_key[action.request or 0], events, now)
            elif action.kind == "rotate":
                victim, head = by_key[action.request or 0], by_key[action.head or 0]
                waited = now - head.park.parked_at
                self.moves.park(victim, _mode(action.mode), action.buffer_capacity, events, now)
                self.stats.rotations_total += 1
                log.info(
                    "rotated out request %s: a head parked %.1f s takes its turn",
                    victim.request_id,
                    waited,
                )
                self.moves.resume(head, events, now)
            elif action.kind == "fail":
                req = by_key[action.request or 0]
                log.warning(
                    "request %s cannot fit the pool of %d cells even alone, failing it",
                    req.request_id,
                    self.scheduler.pool.n_cells,
                )
                self.failed.append(req)
                events.fail(req.request_id, CONTEXT_ERROR, "exceed_context_size_error")

    def _park_on_schedule(self, events: ParkNotices, now: float) -> None:
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
                mode: ParkMode = "swap" if fits and self.budget_bytes != 0 else "recompute"
                self.moves.park(req, mode, need, events, now)


def _mode(name: str | None) -> ParkMode:
    return "recompute" if name == "recompute" else "swap"


# ---- the snapshot the Rust planner reads each step: one RequestView per request in a slot
#
# ::
#
#     scheduler.running       "running"    next_cells: the cells it holds after this step's rows
#     scheduler.transferring  "parking"    a copy out in flight: its cells still held, no step
#                             "restoring"  a copy back in flight into cells it holds: charged for
#                                          the step it takes once the copy lands
#     scheduler.parked        "parked"     resume_cells: what it needs to come back and run a step
#
# In-flight requests are neither victims nor resumable, and their buffers are busy. The pool still
# counts a parking request's cells, so the planner cannot know they are about to be freed; rather
# than lie about occupancy (the planner reads it from the pool, never from the views), Preemption
# never parks another request for pressure while a park copy is in flight: it waits for that copy
# to land and plans again (``Preemption.before_step`` and ``relieve``).


def planner_views(
    sched: Scheduler, parking: Parking, now: float, rows: dict[int, int]
) -> list[RequestView]:
    """``rows``: the step's next rows (``Scheduler.next_rows``), computed once by the caller."""
    views = []
    for req in sched.running:
        seqs = req.live_sequences
        next_cells = [(s.seq_id, s.num_computed + rows.get(s.seq_id, 0)) for s in seqs]
        views.append(_view(sched, parking, req, "running", [s.seq_id for s in seqs], next_cells))
    budget = sched.config.max_batch_tokens
    for req in sched.transferring:
        seq = req.sequences[0]
        if req.state is RequestState.RESTORING:
            after = seq.num_computed + rows_wanted(seq, budget)
            views.append(
                _view(sched, parking, req, "restoring", [seq.seq_id], [(seq.seq_id, after)])
            )
        else:
            views.append(_view(sched, parking, req, "parking", [seq.seq_id], []))
    for req in sched.parked:
        seq = req.sequences[0]
        # a swap comes back with its cells plus one step; a recompute with its whole replay,
        # so that it is not parked again halfway through it
        # (behind a sliding window: at most the window and one step's rows at any time)
        cells, chunk = sched.cells, min(budget, sched.cells.window_rows() or budget)
        need = (
            min(len(seq.tokens), cells.window_cells(chunk) if cells.window else len(seq.tokens))
            if req.park.mode == "recompute"
            else cells.held_after(seq.num_computed, rows_wanted(seq, chunk))
        )
        views.append(_view(sched, parking, req, "parked", [], [], resume_cells=need))
    return views


def _view(
    sched: Scheduler,
    parking: Parking,
    req: Request,
    state: Literal["running", "parked", "parking", "restoring"],
    seq_ids: list[int],
    next_cells: list[tuple[int, int]],
    resume_cells: int = 0,
) -> RequestView:
    seq = req.sequences[0]
    park = req.park
    parked = state in ("parked", "parking")
    pool = sched.pool
    # a swap saves what the sequence holds: not its positions behind a sliding window
    released = pool.released_cells(seq.seq_id) if pool.has_sequence(seq.seq_id) else park.released
    return RequestView(
        id=req.key,
        arrival=req.key,
        state=state,
        mode=park.mode if state == "parked" else None,
        seq_ids=seq_ids,
        next_cells=next_cells,
        resume_cells=resume_cells,
        state_bytes=parking.state_bytes(seq.num_computed - released),
        parks=park.parks,
        parked_at_ms=int(park.parked_at * 1000) if parked else None,
        resumed_at_ms=None if park.resumed_at is None else int(park.resumed_at * 1000),
        tokens_since_resume=seq.num_output - park.output_at_resume,
        family=len(req.sequences) > 1,
        refused=False,
        # a family member that finished gave its slot back; families never park anyway
        slot=next(
            (sched.slot_of[s.seq_id] for s in req.live_sequences if s.seq_id in sched.slot_of),
            0,
        ),
    )
