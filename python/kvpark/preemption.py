"""Parks and resumes: what the Rust planner is shown each step, and how its actions are carried out.

Each step, before the batch is built (every request sits at a token boundary)::

    scheduler state ──snapshot──► _core.Planner.plan(pool, views, buffers, now) ──► actions
    actions: release_buffer | park(swap|recompute) | resume | rotate | fail
    park:    swap → Parking.swap_out (copy cells to the slot's host buffer), then free the cells;
             recompute, or a failed host allocation → free the cells; the tokens replay on resume
    resume:  fresh pages; swap → Parking.swap_in; recompute → its known tokens become prompt rows

``park_moves.py`` carries each park and resume out, through the in-flight states ``parking`` and
``restoring`` when the copy is asynchronous; this file decides them and lands the copies first.

A replay never draws from the request's generator: only a sequence's newest token is sampled, and
that draw would have happened without the park too.
"""

from __future__ import annotations

import logging
import time

from kvpark._core import Action, Planner
from kvpark.config import SchedulerConfig
from kvpark.env import Knobs
from kvpark.outputs import ErrorEvent
from kvpark.park_moves import Events as Events
from kvpark.park_moves import ParkMoves
from kvpark.parking import Parking
from kvpark.planner_views import planner_views
from kvpark.request import ParkMode, Request
from kvpark.scheduler import CONTEXT_ERROR, Scheduler
from kvpark.stats import EngineStats, Observations

log = logging.getLogger("kvpark.preempt")
MIB = 2**20
MARGIN_CELLS = 8  # headroom the planner keeps free (rounded up to a page)
# An async park frees its cells only when its copy lands, so it must start early enough to leave
# room for the steps in between: this many rows of runway per running request (original §3.2).
ASYNC_RUNWAY_STEPS = 8


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
        self._planners: dict[int, Planner] = {}  # by margin; see _planner()
        self.moves = ParkMoves(scheduler, parking, stats, observations)
        self.failed: list[Request] = []  # failed by a planner action; the engine releases them

    # ----------------------------------------------------------------- each step
    @property
    def asynchronous(self) -> bool:
        return self.parking.asynchronous

    def before_step(self, events: Events) -> None:
        self.moves.land(events)
        self._refresh_gauges()
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
            self._refresh_gauges()

    def relieve(self, shortfall: int, events: Events) -> bool:
        """A step's decodes lack ``shortfall`` cells: park victims. False when nobody can go."""
        if self.moves.parks_in_flight():  # their cells are what the step lacks
            self.moves.land(events, wait_parks=True)
            return True
        now = time.monotonic()
        views = planner_views(self.scheduler, self.parking, now)
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
        self._refresh_gauges()

    # ----------------------------------------------------------------- planning
    def _planner(self) -> Planner:
        margin = MARGIN_CELLS
        if self.parking.asynchronous:
            margin += ASYNC_RUNWAY_STEPS * (
                len(self.scheduler.running) + len(self.scheduler.transferring)
            )
        planner = self._planners.get(margin)
        if planner is None:
            # planner off: plan() parks nothing for pressure (resumes still come from it); a step
            # that fails to allocate asks choose_victims() instead
            planner = self._planners[margin] = Planner(
                policy="cost" if self.config.preempt_policy == "cost" else "fcfs",
                margin_cells=margin,
                ram_budget_bytes=self.budget_bytes,
                park_ahead=self.knobs.preempt_planner,
            )
        return planner

    def _plan(self, now: float) -> list[Action]:
        views = planner_views(self.scheduler, self.parking, now)
        return self._planner().plan(
            self.scheduler.pool, views, self.parking.capacities(), int(now * 1000)
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
                events.add(req, ErrorEvent(CONTEXT_ERROR, 500, "exceed_context_size_error"))
        self._refresh_gauges()

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
                self.moves.park(req, mode, need, events, now)

    def _refresh_gauges(self) -> None:
        in_transfer = len(self.scheduler.transferring)  # parking or restoring: counted as parked
        self.stats.requests_preempted = len(self.scheduler.parked) + in_transfer
        self.stats.preempt_ram_bytes = self.parking.held_bytes


def _mode(name: str | None) -> ParkMode:
    return ParkMode.RECOMPUTE if name == "recompute" else ParkMode.SWAP
