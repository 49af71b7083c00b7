"""kvpark's default CPU path against llama.cpp's greedy tokens on the parity prompts.

tests/data/llamacpp_greedy.json holds, for each parity prompt (its token ids too), llama.cpp's 32
greedy tokens and its two best tokens with their log-probabilities at every step, made by
`kvpark bench --scenario llamacpp-reference` with llama-server on the default GGUF (the file
says how to remake it).

What "agree" means. The two do not compute the same sums: llama.cpp rounds every activation row to
8-bit blocks (q8_1) before its Q4_1 dot products and keeps K/V in float16; kvpark multiplies the
Q4_1 blocks by int8 activations of its own rounding (the default, ``--block-dot int8``) or by
float32 ones (``--block-dot float32``), and keeps K/V in float16 under int8 activations and
bfloat16 under float32 ones by default (``--kv-dtype auto``). Where llama.cpp's two best tokens
are nearly tied the two may pick differently, and after that their contexts differ and a
free-running comparison has nothing left to compare. On
these prompts that happens early (the first prompt's first token is a tie: "L" at -1.92 against
"The" at -2.01 in llama.cpp; kvpark with float32 activations and transformers fp32 both pick
"The"), so "the first 16 of 32 tokens equal" would fail a correct implementation. The rule
instead, at every step (``step_fault``, with its constants in tests/support/llamacpp.py, since
the KV pool rule of test_cpu_path_greedy.py applies it too):

- kvpark's log-probability of llama.cpp's greedy token is within ``LOGPROB_TOL`` of llama.cpp's;
- kvpark's greedy token is llama.cpp's, or, at a near-tie, llama.cpp's second: both llama.cpp's
  lead of its first over its second and kvpark's lead of that second over llama.cpp's first are
  under ``NEAR_TIE``.

It is applied on llama.cpp's own contexts (the prompt plus its first i greedy tokens, i = 0..31:
teacher forcing, through kvpark's prompt path), and free-running (kvpark's decode path: its 32
tokens must equal llama.cpp's up to the first step where they part, and that step must pass).

The numbers, measured on 2026-12-01 (AVX2 machine, block weights, bf16 KV cells) on the 96 forced
steps, against transformers in float64 on the same dequantised weights: for llama.cpp's greedy
token, kvpark with float32 activations (``--block-dot float32``) is off by 0.003 nats (median),
0.08 at most; llama.cpp by 0.03, 0.27 at most (its 8-bit activations; on its second choice up to
1.4, which is why only its greedy token's log-probability is compared). ``LOGPROB_TOL`` = 0.5 nats
is about twice llama.cpp's own largest error; ``NEAR_TIE`` = 1 nat is a factor e in probability.
kvpark against llama.cpp: float32 block dot, free-running prefixes 0 / 14 / 32 of 32, 91 of 96
forced steps equal, the other 5 at llama.cpp leads under 0.13 nats, logprob differences median
0.03, max 0.22; int8 block dot (llama.cpp's own arithmetic), prefixes 32 / 14 / 32, 94 of 96, the
other 2 at leads under 0.01 nats, median 0.03, max 0.21. A numerics bug (a wrong block scale, a
misread cell, a broken norm) moves log-probabilities by whole nats and flips decisive steps.

Under int8 each KV pool, measured 2026-12-05 after the attention kernel took its own polynomial
exp and 16-lane dot (the same bits on every ISA): float32 cells, prefixes 7 / 14 / 25, 5 of 96
forced steps at llama.cpp's second, |logprob diff| median 0.033, max 0.438; float16 (llama.cpp's
own cell format, the default), 15 / 32 / 11, 3 of 96, 0.033, 0.291; bfloat16, 7 / 14 / 32, 5 of
96, 0.045, 0.524: one fault, prompt 0 step 9, 0.52 nats off llama.cpp's log-probability.
test_cpu_path_greedy.py judges the pool rule under int8 on these (docs/cpu-kernels.md, "The KV
pool's cells").
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

import kvpark
from support.llamacpp import N_TOKENS, Steps, judge, load_reference, run_steps, step_fault


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return load_reference()


@pytest.fixture(scope="module", params=["float32", "int8"])
def llm(default_gguf_path: str, request: pytest.FixtureRequest) -> kvpark.LLM:
    """kvpark's default, ``--block-dot int8`` (llama.cpp's own arithmetic), and ``--block-dot
    float32`` (float32 activations), each with the pool the pool rule gives it (f16 cells under
    int8, bf16 under float32)."""
    torch.set_num_threads(1)
    llm = kvpark.LLM(default_gguf_path, threads=1, kv_cells=4096, block_dot=request.param)
    want = "float16" if request.param == "int8" else "bfloat16"
    assert llm.engine.runner.cpu_paths.kv_dtype == want  # type: ignore[attr-defined]
    return llm


@pytest.fixture(scope="module")
def steps(reference: dict[str, Any], llm: kvpark.LLM) -> Steps:
    return run_steps(llm, reference)


def test_the_reference_is_for_this_gguf_and_these_prompts(
    default_gguf_path: str, reference: dict[str, Any], llm: kvpark.LLM
) -> None:
    """A different GGUF or tokenizer would make the comparison meaningless: remake the file."""
    digest = hashlib.sha256(Path(default_gguf_path).read_bytes()).hexdigest()
    assert digest == reference["gguf"]["sha256"], f"remake it: {reference['remake']}"
    for prompt in reference["prompts"]:
        chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt["question"]}])
        assert llm.tokenizer.encode(chat, add_special_tokens=False) == prompt["prompt_ids"]
        assert len(prompt["greedy_ids"]) == len(prompt["top2"]) == N_TOKENS


def test_on_llama_cpps_contexts_every_step_agrees(
    reference: dict[str, Any], steps: Steps, llm: kvpark.LLM
) -> None:
    agreement = judge(steps, reference)
    paths = llm.engine.runner.cpu_paths  # type: ignore[attr-defined]
    print(f"{paths.summary()}: {agreement.summary()}")
    assert not agreement.forced_faults, agreement.forced_faults


def test_free_running_greedy_parts_from_llama_cpp_only_at_a_near_tie(
    reference: dict[str, Any], steps: Steps
) -> None:
    agreement = judge(steps, reference)
    assert not agreement.free_faults, agreement.free_faults


def test_the_rule_fails_a_decisive_flip_or_a_far_logprob() -> None:
    top2 = [[7, -0.1], [9, -2.5]]
    assert step_fault(7, {7: -0.2, 9: -2.4}, top2) is None
    assert step_fault(9, {9: -0.2, 7: -0.3}, top2) is not None  # llama.cpp led by 2.4 nats
    assert step_fault(7, {7: -1.2}, top2) is not None  # same token, logprob 1.1 nats off
    assert step_fault(3, {3: -0.1, 7: -0.3}, top2) is not None  # not one of llama.cpp's two
    assert step_fault(9, {9: -0.1}, top2) is not None  # llama.cpp's pick not in kvpark's best
    near = [[7, -0.3], [9, -0.5]]
    assert step_fault(9, {9: -0.35, 7: -0.4}, near) is None  # a near-tie both ways
    assert step_fault(9, {9: -0.05, 7: -1.2}, [[7, -0.9], [9, -1.0]]) is not None  # kvpark's lead
