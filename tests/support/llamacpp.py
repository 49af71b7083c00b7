"""kvpark's steps against llama.cpp's recorded greedy tokens, by one rule (``step_fault``), for
tests/model/test_llamacpp_greedy.py (which says what the rule is and why) and for the KV pool
rule under int8 activations in tests/runner/test_cpu_path_greedy.py.

tests/data/llamacpp_greedy.json holds, for each parity prompt (its token ids too), llama.cpp's
32 greedy tokens and its two best tokens with their log-probabilities at every step.
``run_steps`` takes kvpark's steps once (teacher-forced on llama.cpp's contexts, then
free-running); ``judge`` measures them against a reference, so that the same steps can be judged
against a deliberately wrong reference too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvpark
from kvpark import SamplingParams
from kvpark.engine.llm import RequestOutput

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "llamacpp_greedy.json"
N_TOKENS = 32
LOGPROB_TOL = 0.5  # nats
NEAR_TIE = 1.0  # nats
TOP = 5  # kvpark's alternatives per step: llama.cpp's best is among them unless far off

Step = tuple[int, dict[int, float]]  # kvpark's token and its best log-probabilities by id


def load_reference() -> dict[str, Any]:
    reference: dict[str, Any] = json.loads(REFERENCE.read_text())
    return reference


def step_fault(mine: int, mine_top: dict[int, float], ref_top2: list[list[float]]) -> str | None:
    """Why kvpark's step (its token, its best log-probabilities by id) disagrees with llama.cpp's
    two best ``[[id, logprob], [id, logprob]]``, or None when it agrees (test_llamacpp_greedy's
    rule)."""
    (best, best_lp), *rest = ((int(t), lp) for t, lp in ref_top2)
    if best not in mine_top:
        return f"llama.cpp's pick {best} is not among kvpark's best {TOP}"
    if abs(mine_top[best] - best_lp) > LOGPROB_TOL:
        return f"logprob of {best}: {mine_top[best]:.3f}, llama.cpp {best_lp:.3f}"
    if mine == best:
        return None
    if not rest or mine != rest[0][0]:
        return f"picked {mine}, not one of llama.cpp's two best {[best] + [t for t, _ in rest]}"
    theirs, ours = best_lp - rest[0][1], mine_top[mine] - mine_top[best]
    if theirs >= NEAR_TIE or ours >= NEAR_TIE:
        return f"picked {mine} over {best}: not a near-tie (leads {theirs:.3f}, {ours:.3f})"
    return None


def common_prefix(a: list[int], b: list[int]) -> int:
    differ = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(differ, min(len(a), len(b)))


def tops(output: RequestOutput) -> list[Step]:
    """(token, {id: logprob} of the best ``TOP``) per step of an output."""
    steps = output.choices[0].logprobs or []
    return [(lp.token_id, {**dict(lp.top), lp.token_id: lp.logprob}) for lp in steps]


@dataclass
class Steps:
    """kvpark's steps on the reference's prompts: ``forced[k][i]`` on prompt k's context plus
    llama.cpp's first i greedy tokens, ``free[k]`` its own 32 greedy steps."""

    forced: list[list[Step]]
    free: list[list[Step]]


def run_steps(llm: kvpark.LLM, reference: dict[str, Any]) -> Steps:
    forced = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=TOP)
    steps = Steps([], [])
    for prompt in reference["prompts"]:
        contexts = [prompt["prompt_ids"] + prompt["greedy_ids"][:i] for i in range(N_TOKENS)]
        one = [tops(out) for out in llm.generate(contexts, forced)]
        assert all(len(t) == 1 for t in one)  # a token each
        steps.forced.append([t[0] for t in one])
    free = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate([p["prompt_ids"] for p in reference["prompts"]], free)
    steps.free = [tops(out) for out in outputs]
    return steps


@dataclass
class Agreement:
    """How kvpark's steps agree with a reference: the rule's faults, teacher-forced and
    free-running (where the free run first parts from llama.cpp's tokens, or none), the forced
    steps that picked llama.cpp's second (near-ties), |logprob - llama.cpp's| of llama.cpp's
    greedy token at each forced step, and each prompt's free-running common prefix."""

    forced_faults: list[str] = field(default_factory=list)
    free_faults: list[str] = field(default_factory=list)
    flips: int = 0
    diffs: list[float] = field(default_factory=list)
    prefixes: list[int] = field(default_factory=list)

    @property
    def faults(self) -> list[str]:
        return self.forced_faults + self.free_faults

    def summary(self) -> str:
        diffs = sorted(self.diffs)
        return (
            f"free-running prefixes {self.prefixes} of {N_TOKENS}; teacher-forced {self.flips} "
            f"of {len(diffs)} steps picked llama.cpp's second (near-ties), {len(self.faults)} "
            f"faults; |logprob - llama.cpp's| max {diffs[-1]:.3f}, median "
            f"{diffs[len(diffs) // 2]:.3f} nats"
        )


def judge(steps: Steps, reference: dict[str, Any]) -> Agreement:
    got = Agreement()
    for k, prompt in enumerate(reference["prompts"]):
        assert len(steps.forced[k]) == len(steps.free[k]) == N_TOKENS
        for i, (mine, mine_top) in enumerate(steps.forced[k]):
            best, best_lp = prompt["top2"][i][0]
            got.flips += mine != best
            if best in mine_top:
                got.diffs.append(abs(mine_top[best] - best_lp))
            if (fault := step_fault(mine, mine_top, prompt["top2"][i])) is not None:
                got.forced_faults.append(f"prompt {k} step {i}: {fault}")
        n = common_prefix([t for t, _ in steps.free[k]], prompt["greedy_ids"])
        got.prefixes.append(n)
        if n < N_TOKENS:  # the same context up to here: the step must pass the rule
            mine, mine_top = steps.free[k][n]
            if (fault := step_fault(mine, mine_top, prompt["top2"][n])) is not None:
                got.free_faults.append(f"prompt {k} step {n}: {fault}")
    return got
