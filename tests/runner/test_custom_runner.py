"""A runner written only against the public protocol (tests/support/hf_runner.py: transformers'
Llama with its own paged K/V) drives the engine end to end: its greedy tokens equal the built-in
runner's, alone, together, as n=2 choices, and across forced swap and recompute parks and real
pressure; every cell comes back; exact mode refuses it (it declares row_invariant = False).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvpark
from kvpark import SamplingParams
from support.hf_runner import HFRunner, load_hf_llama

# tests/model/test_model_parity.py shows transformers and kvpark agree on these for 32 tokens
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue.",
]
N_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path: str) -> kvpark.Tokenizer:
    return kvpark.load_tokenizer(default_gguf_path)


@pytest.fixture(scope="module")
def prompts(tokenizer: kvpark.Tokenizer) -> list[list[int]]:
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def builtin(prompts: list[list[int]]) -> list[list[int]]:
    """The built-in runner's greedy tokens for each prompt, in float32 (float32 activations
    against the blocks too: transformers' dense float32 agrees with that product, while int8
    activations take the first prompt's first-token near-tie the other way)."""
    torch.set_num_threads(1)
    llm = kvpark.LLM(dtype="float32", block_dot="float32", kv_cells=1024, parallel=4, preempt=False)
    return [out.token_ids for out in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def hf_factory(default_gguf_path: str, tokenizer: kvpark.Tokenizer) -> kvpark.RunnerFactory:
    model = load_hf_llama(default_gguf_path)
    name = f"hf:{Path(default_gguf_path).name}"
    # one set of weights for every engine here; each engine gets a runner with its own K/V
    return lambda config: HFRunner(model, tokenizer, config, name)


@pytest.fixture
def make(hf_factory: kvpark.RunnerFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``make(every=0, fail_save=False, planner="on", **options)``: an LLM on the HF runner."""
    made: list[kvpark.LLM] = []

    def build(
        every: int = 0, fail_save: bool = False, planner: str = "on", **options: Any
    ) -> kvpark.LLM:
        monkeypatch.setenv("KVPARK_PREEMPT_EVERY", str(every))  # read when the engine starts
        monkeypatch.setenv("KVPARK_PREEMPT_FAIL_SAVE", "1" if fail_save else "0")
        monkeypatch.setenv("KVPARK_PREEMPT_PLANNER", planner)
        options.setdefault("kv_cells", 1024)
        options.setdefault("parallel", 4)
        llm = kvpark.LLM(runner=hf_factory, **options)
        made.append(llm)
        return llm

    yield build
    for llm in made:  # every cell, slot and park buffer back, whatever the test did
        engine = llm.engine
        assert not engine.has_work
        assert engine.scheduler.pool.cells_used() == 0
        engine.scheduler.pool.check_integrity()
        assert engine.stats.preempt_ram_bytes == 0 and engine.stats.requests_preempted == 0


def test_the_engine_reads_the_runner_through_the_protocol(make: Any) -> None:
    llm = make()
    assert isinstance(llm.engine.runner, HFRunner)
    assert isinstance(llm.engine.runner, kvpark.Runner)
    assert llm.engine.model_name.startswith("hf:")
    assert llm.engine.vocab_size == llm.engine.runner.vocab_size


def test_greedy_tokens_equal_the_builtin_runner_prompt_by_prompt(
    make: Any, prompts: list[list[int]], builtin: list[list[int]]
) -> None:
    llm = make()
    got = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    assert got == builtin
    assert all(len(t) == N_TOKENS for t in got)


def test_prompts_together_in_chunks_equal_the_builtin_runner(
    make: Any, prompts: list[list[int]], builtin: list[list[int]]
) -> None:
    # 24 rows a step: prompts arrive in chunks beside other sequences' decode rows, so the runner
    # also sees items that start mid-sequence with several rows
    llm = make(max_batch_tokens=24)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == builtin


def test_n2_choices_share_the_prompt_and_both_decode_greedily(
    make: Any, prompts: list[list[int]], builtin: list[list[int]]
) -> None:
    out = make().generate(
        prompts[0], SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True, n=2)
    )
    assert out[0].error is None
    assert [c.token_ids for c in out[0].choices] == [builtin[0], builtin[0]]


def test_forced_swap_parks_change_no_token(
    make: Any, prompts: list[list[int]], builtin: list[list[int]]
) -> None:
    llm = make(every=6)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == builtin
    assert all(o.finished is not None and o.finished.parks >= 3 for o in outs)
    assert all(o.finished is not None and o.finished.recomputes == 0 for o in outs)
    stats = llm.engine.stats
    assert stats.resumes_total == stats.preemptions_total["swap"] >= 9


def test_forced_recompute_parks_change_no_token(
    make: Any, prompts: list[list[int]], builtin: list[list[int]]
) -> None:
    llm = make(every=6, fail_save=True)  # every swap's host allocation fails: all recompute
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == builtin
    assert all(o.finished is not None and o.finished.recomputes >= 3 for o in outs)
    assert llm.engine.stats.preemptions_total["swap"] == 0
    assert llm.engine.stats.recomputed_tokens_total > 0


def test_a_pool_too_small_for_all_parks_on_failed_allocations_and_finishes(
    make: Any, prompts: list[list[int]], builtin: list[list[int]]
) -> None:
    # 7 pages: two prompts of ~40 tokens are admitted (3 pages each and a page of headroom), then
    # both grow to 4 pages; with the planner off, one parks when a step fails to allocate
    llm = make(kv_cells=112, planner="off")
    outs = llm.generate(prompts, GREEDY)
    assert [o.error for o in outs] == [None] * 3
    assert [o.token_ids for o in outs] == builtin
    assert sum(o.finished.parks for o in outs if o.finished is not None) >= 1


def test_exact_mode_refuses_a_runner_that_is_not_row_invariant(
    hf_factory: kvpark.RunnerFactory,
) -> None:
    with pytest.raises(ValueError, match=r"HFRunner: it declares row_invariant = False"):
        kvpark.LLM(runner=hf_factory, exact=True, kv_cells=256)
