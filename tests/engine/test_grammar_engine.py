"""Structured output across parks and in exact mode, on the real default model.

The grammar state is sampler state: a swap park leaves it as it is and a recompute replay (which
samples nothing) never advances it, so a constrained answer is the unparked one. In exact mode a
constrained request keeps its bitwise guarantee whatever its neighbours, chunking and parks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

import kvpark
from kvpark import SamplingParams
from kvpark.engine.llm_engine import LLMEngine
from kvpark.engine.outputs import TokenEvent, TokenLogprob
from kvpark.sampling.grammar import GrammarState
from kvpark.sampling.params import Constraint
from support.preempt import assert_clean

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer"},
        "rivers": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["city", "population", "rivers"],
    "additionalProperties": False,
}
JSON = Constraint("json_schema", json.dumps(SCHEMA))
PROMPT = "Describe Paris as JSON: its name, population and rivers."
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=48, logprobs=2, constraint=JSON),
    "seeded": SamplingParams(temperature=0.7, seed=11, max_tokens=80, logprobs=2, constraint=JSON),
}


def make(monkeypatch: pytest.MonkeyPatch, every: int = 0, **options: object) -> kvpark.LLM:
    torch.set_num_threads(1)
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", str(every))
    monkeypatch.setenv("KVPARK_PREEMPT_FAIL_SAVE", "0")
    monkeypatch.setenv("KVPARK_PREEMPT_PLANNER", "on")
    options.setdefault("dtype", "float32")
    options.setdefault("kv_cells", 1024)
    options.setdefault("parallel", 4)
    return kvpark.LLM(**options)


def answers(out: kvpark.RequestOutput) -> list[tuple[str, list[int], list[float] | None]]:
    return [
        (c.text, c.token_ids, [lp.logprob for lp in c.logprobs] if c.logprobs else None)
        for c in out.choices
    ]


def count_advances(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every token committed to any grammar state, in order."""
    seen: list[int] = []
    advance = GrammarState.advance

    def counted(self: GrammarState, token: int) -> bool:
        seen.append(token)
        return advance(self, token)

    monkeypatch.setattr(GrammarState, "advance", counted)
    return seen


@pytest.mark.parametrize("kind", list(PARAMS))  # KVPARK_PREEMPT_EVERY parks single choices only
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_forced_parks_leave_the_constrained_output_unchanged(
    monkeypatch: pytest.MonkeyPatch, kind: str, mode: str
) -> None:
    p = PARAMS[kind]
    plain = make(monkeypatch, preempt=False).generate(PROMPT, p)[0]
    for c in plain.choices:
        assert c.finish_reason == "stop" and json.loads(c.text)["population"] >= 0
    options: dict[str, object] = {"preempt_ram_mib": 0} if mode == "recompute" else {}
    llm = make(monkeypatch, every=5, **options)
    advanced = count_advances(monkeypatch)
    parked = llm.generate(PROMPT, p)[0]
    assert parked.finished is not None and parked.finished.parks >= 2
    assert parked.finished.recomputes == (parked.finished.parks if mode == "recompute" else 0)
    if mode == "swap":  # a swap is a byte copy: logprobs bit-identical too
        assert answers(parked) == answers(plain)
    else:  # a replay recomputes K and V: the same tokens (normal mode promises no more)
        assert [c.token_ids for c in parked.choices] == [c.token_ids for c in plain.choices]
    # each emitted token went into its choice's grammar exactly once, replays included
    assert sorted(advanced) == sorted(t for c in parked.choices for t in c.token_ids)
    assert_clean(llm)


def run(
    engine: LLMEngine, neighbours: list[tuple[int, str, SamplingParams]], probe: SamplingParams
) -> list[tuple[int, TokenLogprob]]:
    """The probe's tokens with their logprobs, run beside neighbours added at their steps."""
    tok = engine.tokenizer
    pending = sorted(
        [(0, "probe", PROMPT, probe)]
        + [(s, f"n{i}", t, p) for i, (s, t, p) in enumerate(neighbours)],
        key=lambda x: x[0],
    )
    got: list[tuple[int, TokenLogprob]] = []
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
                    assert ev.logprobs is not None or not ev.token_ids
                    got.extend(zip(ev.token_ids, ev.logprobs or [], strict=True))
        step += 1
    assert engine.scheduler.pool.cells_used() == 0
    return got


NEIGHBOURS = [  # short: exact mode's dense float32 torch path is slow on two shared cores
    (0, "Write a haiku.", SamplingParams(temperature=0.7, seed=3, max_tokens=8, ignore_eos=True)),
    (
        2,
        "List five primes.",
        SamplingParams(
            temperature=0.0,
            max_tokens=10,
            constraint=Constraint("regex", "[0-9]+(, [0-9]+){4}", "guided_regex"),
        ),
    ),
    (3, "London as JSON.", SamplingParams(temperature=1.2, seed=9, max_tokens=10, constraint=JSON)),
]
SETUPS = {  # two engines, not one per knob: exact mode's torch path is slow on two shared cores
    "chunked prompts and swap parks": ({"max_batch_tokens": 7}, 4),
    "recompute parks": ({"preempt_ram_mib": 0}, 4),
}
EXACT = {"exact": True, "weights": "dense", "runner": "torch", "kv_cells": 2048, "parallel": 8}
PROBES = {kind: replace(PARAMS[kind], max_tokens=16) for kind in PARAMS}
Trace = list[tuple[int, TokenLogprob]]


@pytest.fixture(scope="module")
def alone() -> Iterator[dict[str, Trace]]:
    mp = pytest.MonkeyPatch()
    engine = make(mp, **EXACT).engine
    traces = {kind: run(engine, [], probe) for kind, probe in PROBES.items()}
    for trace in traces.values():  # the probe's tokens are a valid start of the schema
        state = engine.grammars.state(JSON)
        assert len(trace) == 16 and all(state.advance(t) for t, _ in trace)
    yield traces
    mp.undo()


@pytest.mark.parametrize("setup", list(SETUPS))
def test_exact_mode_keeps_a_constrained_request_bitwise(
    monkeypatch: pytest.MonkeyPatch, alone: dict[str, Trace], setup: str
) -> None:
    options, every = SETUPS[setup]
    llm = make(monkeypatch, every=every, **{**EXACT, **options})
    for kind, probe in PROBES.items():
        beside = run(llm.engine, NEIGHBOURS, probe)
        assert beside == alone[kind], kind  # tokens and logprobs (float equality: bitwise)
    assert llm.engine.stats.resumes_total > 0
