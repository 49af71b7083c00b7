"""The scheduler driven without a model (tests/sched): a scheduler, a request, and what the engine
does after a step, with every draw simulated."""

from __future__ import annotations

from kvpark.config.layers import PoolConfig, SchedulerConfig
from kvpark.sampling.params import SamplingParams
from kvpark.sched.plan import StepPlan
from kvpark.sched.request import Request
from kvpark.sched.scheduler import Scheduler


def make(
    kv_cells: int = 256, page_size: int = 16, parallel: int = 4, budget: int = 32
) -> Scheduler:
    return Scheduler(
        PoolConfig(kv_cells=kv_cells, page_size=page_size),
        SchedulerConfig(parallel=parallel, max_batch_tokens=budget),
        max_model_len=kv_cells,
    )


def request(rid: str, prompt_len: int, n: int = 1, max_tokens: int = 8) -> Request:
    return Request(
        rid, list(range(1, prompt_len + 1)), SamplingParams(n=n, max_tokens=max_tokens), 0
    )


def advance(sched: Scheduler, plan: StepPlan, token: int = 7) -> None:
    """What the engine does after a step: mark rows computed, append a drawn token where sampled."""
    for item in plan.items:
        req, seq = sched.by_seq[item.seq_id]
        seq.num_computed = item.start + len(item.token_ids)
        if item.sample:
            if len(req.sequences) < req.params.n:
                sched.fork(req, [token + j for j in range(req.params.n)])
            else:
                seq.tokens.append(token)


def finish_done(sched: Scheduler) -> list[str]:
    """What the engine does after drawing: a choice that has its ``max_tokens`` ends, and a
    request whose choices all ended leaves; returns the ids of those that left."""
    done = []
    for req in list(sched.running):
        if len(req.sequences) < req.params.n:
            continue  # its prompt has not forked yet
        for seq in req.live_sequences:
            if seq.num_output >= req.params.max_tokens:
                sched.finish_sequence(seq, "length")
        if req.finished:
            sched.release(req)
            done.append(req.request_id)
    return done
