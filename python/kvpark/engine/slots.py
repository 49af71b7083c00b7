"""The /slots view: one record per slot, built on the engine thread from scheduler state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpark.sched.request import RequestState

if TYPE_CHECKING:
    from kvpark.engine.llm_engine import LLMEngine


def describe_slots(engine: LLMEngine) -> list[dict[str, object]]:
    sched = engine.scheduler
    slots: list[dict[str, object]] = [_idle(i) for i in range(sched.config.parallel)]
    for seq_id, slot in sched.slot_of.items():
        req, seq = sched.by_seq[seq_id]
        in_prompt = seq.num_computed < seq.prompt_len
        parked = req.state is RequestState.PARKED
        # a copy out (parking) or back (restoring) in flight: never both, never fully parked
        moving = req.state in (RequestState.PARKING, RequestState.RESTORING)
        state = req.state.value if parked or moving else ("prefill" if in_prompt else "decode")
        slots[slot] = {
            "id": slot,
            "state": state,
            "is_processing": True,
            "is_preempted": parked,
            "is_transferring": moving,
            "n_preempt": req.parks,
            "n_recompute": req.recomputes,
            "n_prompt_tokens": seq.prompt_len,
            "n_cached_tokens": req.cached_tokens,  # of the prompt, from the prefix cache
            "n_cells": sched.cells.held(seq_id),
            "n_decoded": seq.num_output,
            "request_id": req.request_id,
        }
    return slots


def _idle(slot: int) -> dict[str, object]:
    return {
        "id": slot,
        "state": "idle",
        "is_processing": False,
        "is_preempted": False,
        "is_transferring": False,
        "n_preempt": 0,
        "n_recompute": 0,
        "n_prompt_tokens": 0,
        "n_cached_tokens": 0,
        "n_cells": 0,
        "n_decoded": 0,
        "request_id": None,
    }
