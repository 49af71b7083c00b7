"""Which requests the step running now holds, and the test knobs' faults inside it.

The engine thread must fail only the requests of a step that raised (engine/step_failures.py), so
it has to know which those were when the step dies. The plan is the one place that says: the
watch wraps the runner's ``execute`` and reads the plan's sequences into request ids before the
model runs. The same spot is where a model bug or a Rust panic would surface, so the fault knobs
(config/env.py: ``KVPARK_FAULT_STEP``, ``_PANIC``, ``_WEDGE``, ``_DIE``) fire there too.

A step counts when it runs the model (its plan has rows); they are numbered from 1.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpark.config.env import Knobs
from kvpark.runner.protocol import Logits
from kvpark.sched.plan import StepPlan

if TYPE_CHECKING:
    from kvpark.engine.llm_engine import LLMEngine

log = logging.getLogger("kvpark.engine.llm_engine")


def panic_exception() -> type[BaseException]:
    """pyo3's ``PanicException``: what a panic in the Rust core raises in Python (a
    ``BaseException``, so ``except Exception`` lets it by). The core checks its inputs, so no
    call provokes a real panic; pyo3 creates the class when ``kvpark._core`` loads, before any
    other pyo3 module (kvpark imports its core first), so the first one is the core's."""
    import kvpark._core  # noqa: F401  (the class exists once the core has loaded)

    for kind in BaseException.__subclasses__():
        if kind.__module__ == "pyo3_runtime" and kind.__name__ == "PanicException":
            return kind
    raise RuntimeError("pyo3's PanicException is not loaded")


class EngineThreadFault(RuntimeError):
    """``KVPARK_FAULT_DIE``: raised by the engine thread's own loop, outside any step."""


class StepWatch:
    """Installed once on an engine's runner, on the engine thread."""

    def __init__(self, engine: LLMEngine, knobs: Knobs) -> None:
        self.steps = 0  # steps that ran the model so far
        self.in_step: set[str] | None = None  # the running step's requests, once its plan is out
        # request id -> (parks, when it last resumed), as the running step began
        self.parks_before: dict[str, tuple[int, float | None]] = {}
        self._knobs = knobs
        self._engine = engine
        self._wedged = threading.Event()  # never set: KVPARK_FAULT_WEDGE waits on it for ever
        execute: Callable[[StepPlan], Logits] = engine.runner.execute
        try:
            # an instance attribute over the runner's method: the engine's own call goes through
            # it, and parking's copies, the CPU paths and /props still see the runner itself
            engine.runner.execute = lambda plan: self._execute(execute, plan)  # type: ignore[method-assign]
            self.installed = True
        except AttributeError:  # a runner with __slots__: failures then fail every running one
            log.warning("cannot watch %s's steps", type(engine.runner).__name__)
            self.installed = False

    def begin(self) -> None:
        """A new step: nothing known about it until its plan reaches the runner; the parks and
        resumes of every request in a slot so far (engine/step_failures.py ``lost_notices``)."""
        self.in_step = None
        sched = self._engine.scheduler
        self.parks_before = {
            req.request_id: (req.park.parks, req.park.resumed_at)
            for group in (sched.running, sched.parked, sched.transferring)
            for req in group
        }

    def _execute(self, execute: Callable[[StepPlan], Logits], plan: StepPlan) -> Logits:
        by_seq = self._engine.scheduler.by_seq
        self.in_step = {by_seq[i.seq_id][0].request_id for i in plan.items if i.seq_id in by_seq}
        self.steps += 1
        n, k = self.steps, self._knobs
        if n in k.fault_step:
            raise RuntimeError(f"KVPARK_FAULT_STEP={n}: the model failed in this step")
        if n == k.fault_panic:
            raise panic_exception()(f"KVPARK_FAULT_PANIC={n}: a panic in this step")
        if n == k.fault_wedge:
            log.warning("KVPARK_FAULT_WEDGE=%d: this step never returns", n)
            self._wedged.wait()
        return execute(plan)

    def after_step(self) -> None:
        """The loop's own fault, between steps (``KVPARK_FAULT_DIE``)."""
        if self.steps and self.steps == self._knobs.fault_die:
            raise EngineThreadFault(f"KVPARK_FAULT_DIE={self.steps}: the engine thread fails")
