"""Exact mode end to end on the real default model: a probe request's tokens and logprobs
are bit-identical alone, beside 1-7 random neighbours started at random steps, under any prompt
chunking, across forced swap and recompute parks, and as one of n choices sharing a prompt.

The control tests swap one invariant op back to its plain version and check that the same
comparison then fails: the harness can see a difference when there is one.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import pytest
import torch

import kvpark
from kvpark import SamplingParams
from kvpark.engine.llm_engine import LLMEngine
from kvpark.engine.outputs import TokenEvent, TokenLogprob
from kvpark.model.ops import attention, linear

PROBE = "Explain why the sky is blue, in three short sentences."
NEIGHBOUR_PROMPTS = [
    "Write a haiku about autumn leaves.",
    "List five prime numbers and explain what makes a number prime.",
    "def fibonacci(n):",
    "Translate 'good morning' into French, Spanish and German.",
    "Once upon a time, in a kingdom by the sea,",
    "What is the capital of Australia? Answer and then tell me about it.",
    "Summarise the plot of Romeo and Juliet.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True, logprobs=5
)

Trace = list[tuple[int, list[TokenLogprob]]]  # per choice: token ids with their logprobs


# the two exact paths on the CPU: the torch model with dense weights and the row-invariant op set
# (whose ops the control tests swap back one by one), and the lean runner's Rust decoder with
# block weights (runner/lean_runner.py), where every step runs in Rust, prompt rows included;
# "torch-blocks" is the lean runner's control: the torch model over the same block kernels
RUNNERS = {
    "torch": {"weights": "dense", "runner": "torch"},
    "lean": {"runner": "lean"},
    "torch-blocks": {"weights": "blocks", "runner": "torch"},
}


def make(
    monkeypatch: pytest.MonkeyPatch, every: int = 0, runner: str = "torch", **options: object
) -> kvpark.LLM:
    torch.set_num_threads(1)
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", str(every))
    monkeypatch.setenv("KVPARK_PREEMPT_FAIL_SAVE", "0")
    monkeypatch.setenv("KVPARK_PREEMPT_PLANNER", "on")
    options.setdefault("dtype", "float32")
    for key, value in RUNNERS[runner].items():
        options.setdefault(key, value)
    options.setdefault("kv_cells", 2048)
    options.setdefault("parallel", 8)
    llm = kvpark.LLM(exact=True, **options)
    assert getattr(llm.engine.runner, "runner_kind", "torch") == RUNNERS[runner]["runner"]
    return llm


def run(
    engine: LLMEngine,
    probe: SamplingParams,
    neighbours: list[tuple[int, str, SamplingParams]] = (),  # type: ignore[assignment]
    probe_step: int = 0,
) -> dict[int, list[TokenLogprob]]:
    """Run the probe (added at ``probe_step``) and the neighbours (each added at its step) to the
    end; the probe's logprobs per choice."""
    tok = engine.tokenizer
    pending = sorted(
        [(probe_step, "probe", PROBE, probe)]
        + [(s, f"n{i}", text, p) for i, (s, text, p) in enumerate(neighbours)],
        key=lambda x: x[0],
    )
    got: dict[int, list[TokenLogprob]] = {}
    step = 0
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            _, rid, text, params = pending.pop(0)
            ids = tok.encode(text, add_special_tokens=False)
            engine.check_request(ids, params)
            engine.add_request(rid, ids, params)
        for rid, events in engine.step().items():
            for ev in events:
                if rid == "probe" and isinstance(ev, TokenEvent):
                    assert ev.logprobs is not None
                    got.setdefault(ev.index, []).extend(ev.logprobs)
        step += 1
    assert engine.scheduler.pool.cells_used() == 0
    return got


def random_neighbours(rng: random.Random) -> list[tuple[int, str, SamplingParams]]:
    out = []
    for _ in range(rng.randint(1, 7)):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.2]),
            seed=rng.randrange(1000),
            max_tokens=rng.randint(4, 24),
            ignore_eos=True,
        )
        out.append((rng.randint(0, 12), rng.choice(NEIGHBOUR_PROMPTS), params))
    return out


Alone = dict[str, dict[int, list[TokenLogprob]]]


def alone_runs(runner: str) -> Iterator[Alone]:
    mp = pytest.MonkeyPatch()
    llm = make(mp, runner=runner)
    yield {"greedy": run(llm.engine, GREEDY), "seeded": run(llm.engine, SEEDED)}
    mp.undo()


@pytest.fixture(scope="module")
def alone() -> Iterator[Alone]:
    yield from alone_runs("torch")


@pytest.fixture(scope="module")
def alone_lean() -> Iterator[Alone]:
    yield from alone_runs("lean")


PARAMS = {"greedy": GREEDY, "seeded": SEEDED}
SETUPS = {  # engine options and forced-park knob
    "plain": ({}, 0),
    "chunked prompts": ({"max_batch_tokens": 7}, 0),
    "swap parks": ({"max_batch_tokens": 33}, 4),
    "recompute parks": ({"preempt_ram_mib": 0}, 4),
}


@pytest.mark.parametrize("runner", ["torch", "lean"])  # the exact paths; not the control
@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_probe_is_bit_identical_beside_random_neighbours(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    setup: str,
    kind: str,
    runner: str,
) -> None:
    alone: Alone = request.getfixturevalue("alone" if runner == "torch" else "alone_lean")
    options, every = SETUPS[setup]
    llm = make(monkeypatch, every=every, runner=runner, **options)
    rng = random.Random(f"{setup}/{kind}")
    for trial in range(2):
        neighbours = random_neighbours(rng)
        got = run(llm.engine, PARAMS[kind], neighbours, probe_step=rng.randint(0, 6))
        assert got == alone[kind], f"trial {trial} with {len(neighbours)} neighbours"
    stats = llm.engine.stats
    if every:
        mode = "recompute" if "recompute" in setup else "swap"
        assert stats.preemptions_total[mode] > 0, "the knob parked nothing"


def test_n_choices_sharing_a_prompt_are_each_exact(
    alone: dict[str, dict[int, list[TokenLogprob]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = make(monkeypatch, max_batch_tokens=5)
    got = run(llm.engine, dataclasses.replace(SEEDED, n=3), random_neighbours(random.Random(5)))
    assert got[0] == alone["seeded"][0]  # choice 0 draws from the same generator as n=1
    assert len(got) == 3 and got[1] != got[0]


PLAIN_OPS = {
    "linear": {"linear": linear.linear},
    "attention": {
        "prepare_attention": attention.prepare,
        "attention": attention.paged_attention,
    },
}


@pytest.mark.parametrize("op", list(PLAIN_OPS))
def test_the_comparison_fails_when_one_op_is_plain(
    alone: dict[str, dict[int, list[TokenLogprob]]], monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    llm = make(monkeypatch, max_batch_tokens=16)
    runner = llm.engine.runner
    runner.ops = dataclasses.replace(runner.ops, row_invariant=False, **PLAIN_OPS[op])
    neighbours = [(0, text, GREEDY) for text in NEIGHBOUR_PROMPTS[:5]]
    assert run(llm.engine, GREEDY, neighbours, probe_step=2) != alone["greedy"]


def test_the_lean_comparison_fails_when_the_arithmetic_changes(
    alone_lean: Alone, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lean runner's control: the same probe through the torch model's row-invariant ops
    (the same block kernels; torch's silu, rope order and attention instead of the Rust
    decoder's) differs in its bits, so the comparisons above can see a change of that size."""
    llm = make(monkeypatch, runner="torch-blocks", max_batch_tokens=16)
    assert run(llm.engine, GREEDY) != alone_lean["greedy"]
