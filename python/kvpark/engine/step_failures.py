"""What the engine thread does when a step raises, whatever it raised (a Python exception, or a
Rust panic, which pyo3 raises as a ``BaseException``).

Only the requests in the failed step fail: those its plan held (engine/step_watch.py), or, when
it raised before a plan reached the runner, those holding cells. Each is aborted, which frees its
cells, and gets a 500 ``ErrorEvent``; requests waiting or parked behind it run on (with the park
notices the step had for them, lost with its other events). Then the pool's
own integrity check runs (``KvPool.check_integrity``, every invariant in O(pool)): a pool the
failure left broken would corrupt every later step, so that, like an abort that fails and leaves
the pool inconsistent, is :class:`EngineBroken`, which ends the engine.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvpark.engine.outputs import ErrorEvent, NoticeEvent, StreamEvent
from kvpark.runner.failures import RunnerFailed

if TYPE_CHECKING:
    from kvpark.engine.llm_engine import LLMEngine
    from kvpark.engine.step_watch import StepWatch

log = logging.getLogger("kvpark.engine.llm_engine")
STEP_FAILED = "internal error while running the model"


class EngineBroken(RuntimeError):
    """The engine's state cannot be trusted any more: the engine thread stops serving."""


def fail_step(
    engine: LLMEngine, watch: StepWatch, error: BaseException
) -> dict[str, list[StreamEvent]]:
    """The failed step's events: one ``ErrorEvent`` for each of its requests, after they are
    aborted and the pool checked, and the park notices of the others that the step's lost
    events held. :class:`EngineBroken` if the pool is not sound, or if the runner can run no
    more (``RunnerFailed``: a rank of a tensor-parallel group is gone), which ends the engine:
    every request then hears why."""
    if isinstance(error, RunnerFailed):
        log.error("the runner failed: %s", error, exc_info=error)
        raise EngineBroken(f"the runner failed: {error}") from error
    in_step = watch.in_step
    if in_step is None:  # it raised before its plan was out: those that hold cells
        in_step = {req.request_id for req in engine.scheduler.running}
    in_step = set(in_step) | orphans(engine)
    failed = sorted(in_step)
    log.error(
        "a step failed (%s: %s); failing the %d request(s) in it: %s",
        type(error).__name__,
        error,
        len(failed),
        ", ".join(failed) or "none",
        exc_info=error,
    )
    events: dict[str, list[StreamEvent]] = {}
    for request_id in failed:
        try:
            engine.abort(request_id)
        except BaseException:  # the client still hears; the integrity check decides what's left
            log.exception("aborting %s after a failed step failed too", request_id)
        events[request_id] = [ErrorEvent(STEP_FAILED, 500)]
    check_pool(engine, "a failed step")
    return {**lost_notices(engine, watch.parks_before), **events}


def orphans(engine: LLMEngine) -> set[str]:
    """Requests the engine serves that no scheduler group holds: the failed step released them
    (a scheduling decision it raised before reporting) and nobody has told their clients."""
    sched = engine.scheduler
    held = {
        r.request_id
        for g in (sched.waiting, sched.running, sched.parked, sched.transferring)
        for r in g
    }
    return {rid for rid in engine.request_ids if rid not in held}


def lost_notices(
    engine: LLMEngine, before: dict[str, tuple[int, float | None]]
) -> dict[str, list[StreamEvent]]:
    """The park notices the failed step gave requests that run on (parked or resumed as it
    planned, before it raised): its events are lost with it, and a client must not hear a
    resume without its park."""
    sched = engine.scheduler
    notices: dict[str, list[StreamEvent]] = {}
    for req in (*sched.running, *sched.parked, *sched.transferring):
        parks, resumed_at = before.get(req.request_id, (0, None))
        kinds = ["preempted"] * (req.park.parks - parks)
        if req.park.resumed_at != resumed_at:
            kinds += ["resumed", "recomputed"] if req.park.replaying else ["resumed"]
        if kinds:
            notices[req.request_id] = [NoticeEvent(kind) for kind in kinds]
    return notices


def check_pool(engine: LLMEngine, after: str) -> None:
    """The pool's integrity check, logged; :class:`EngineBroken` when it fails."""
    try:
        engine.scheduler.pool.check_integrity()
        if engine.scheduler.cells.space is not None:
            engine.scheduler.cells.space.pool.check_integrity()
    except BaseException as e:
        raise EngineBroken(f"the KV pool's integrity check failed after {after}: {e}") from e
    log.info("the KV pool's integrity check passed after %s", after)
