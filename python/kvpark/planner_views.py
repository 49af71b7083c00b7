"""The snapshot the Rust planner reads each step: one ``RequestView`` per request holding a slot.

::

    scheduler.running       "running"    next_cells: the cells it holds after this step's rows
    scheduler.transferring  "parking"    a copy out in flight: its cells still held, no step
                            "restoring"  a copy back in flight into cells it holds: charged for
                                         the step it takes once the copy lands
    scheduler.parked        "parked"     resume_cells: what it needs to come back and run a step

In-flight requests are neither victims nor resumable, and their buffers are busy. The pool still
counts a parking request's cells, so the planner cannot know they are about to be freed; rather
than lie about occupancy (the planner reads it from the pool, never from the views), Preemption
never parks another request for pressure while a park copy is in flight: it waits for that copy
to land and plans again (``Preemption.before_step`` and ``relieve``).
"""

from __future__ import annotations

from typing import Literal

from kvpark._core import RequestView
from kvpark.parking import Parking
from kvpark.request import ParkMode, Request, RequestState, Sequence
from kvpark.scheduler import Scheduler


def planner_views(sched: Scheduler, parking: Parking, now: float) -> list[RequestView]:
    rows = sched.next_rows()
    views = []
    for req in sched.running:
        seqs = req.live_sequences
        next_cells = [(s.seq_id, s.num_computed + rows.get(s.seq_id, 0)) for s in seqs]
        views.append(_view(sched, parking, req, "running", [s.seq_id for s in seqs], next_cells))
    budget = sched.config.max_batch_tokens
    for req in sched.transferring:
        seq = req.sequences[0]
        if req.state is RequestState.RESTORING:
            after = seq.num_computed + _next_rows(seq, budget)
            views.append(
                _view(sched, parking, req, "restoring", [seq.seq_id], [(seq.seq_id, after)])
            )
        else:
            views.append(_view(sched, parking, req, "parking", [seq.seq_id], []))
    for req in sched.parked:
        seq = req.sequences[0]
        # a swap comes back with its cells plus one step; a recompute with its whole replay,
        # so that it is not parked again halfway through it
        need = (
            len(seq.tokens)
            if req.park.mode is ParkMode.RECOMPUTE
            else seq.num_computed + _next_rows(seq, budget)
        )
        views.append(_view(sched, parking, req, "parked", [], [], resume_cells=need))
    return views


def _next_rows(seq: Sequence, budget: int) -> int:
    return 1 if seq.pending_rows == 1 else min(seq.pending_rows, budget)


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
    return RequestView(
        id=req.key,
        arrival=req.key,
        state=state,
        mode=park.mode.value if state == "parked" and park.mode is not None else None,
        seq_ids=seq_ids,
        next_cells=next_cells,
        resume_cells=resume_cells,
        state_bytes=parking.state_bytes(seq.num_computed),
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
