"""The prefix cache below the engine (issue 13 part 3, at the level of the runner's ops): a
sequence whose page table starts with pages another sequence computed, as a cache hit hands them
out, and which computes only the rest of its prompt gives in exact mode the last row's logits bit
for bit of computing the whole prompt cold. The control: in normal mode, where the cold prompt
takes the torch runner's dense prompt GEMM and the short warm suffix the block kernels, they
differ. Exact mode runs on the CPU's one stack, the lean runner (the Rust decoder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.runner.lean_runner import LeanCpuRunner
from kvpark.runner.torch_runner import TorchRunner
from kvpark.sched.plan import StepItem, StepPlan

PAGE = 16
TEXT = (
    "The lighthouse keeper wrote in his log every evening: the weather, the ships that passed, "
    "the birds that rested on the rail, and the colour of the sea at dusk. On stormy nights he "
    "wrote more: how high the waves climbed the rocks, which lamps he had trimmed, and whether "
    "the old bell on the point had rung by itself. Tonight he wrote"
)


def plan(seq: int, table: list[int], start: int, tokens: list[int], sample: bool) -> StepPlan:
    slots = [table[p // PAGE] * PAGE + p % PAGE for p in range(start, start + len(tokens))]
    return StepPlan([StepItem(seq, start, tokens, sample)], slots, [table])


def last_logits(runner: LeanCpuRunner | TorchRunner, prompt: list[int], split: int) -> np.ndarray:
    """The last prompt row's logits: all rows in one step (``split`` 0), or the first ``split``
    rows by sequence 0 and the rest by sequence 1, whose table starts with 0's pages."""
    own = list(range(8))
    if split == 0:
        return as_numpy(runner.execute(plan(0, own, 0, prompt, True)))[-1]
    runner.execute(plan(0, own, 0, prompt[:split], False))
    hit = own[: split // PAGE]  # the cached pages: sequence 0's, read in place
    table = hit + list(range(8, 16))
    return as_numpy(runner.execute(plan(1, table, split, prompt[split:], True)))[-1]


def as_numpy(logits: object) -> np.ndarray:
    return logits.numpy() if isinstance(logits, torch.Tensor) else np.asarray(logits)


def make(exact: bool) -> LeanCpuRunner | TorchRunner:
    torch.set_num_threads(1)
    pool = PoolConfig(kv_cells=2048, page_size=PAGE)
    if exact:
        return LeanCpuRunner.load(EngineConfig(model=ModelConfig(threads=1, exact=True), pool=pool))
    # the control: float32 dense prompts in the torch runner, so its two paths differ only in
    # the order of their sums
    config = ModelConfig(threads=1, weights="blocks", prompt_path="float32")
    return TorchRunner(config, pool)


def test_a_cached_prefix_gives_the_cold_bits_in_exact_mode() -> None:
    runner = make(exact=True)
    prompt = runner.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(prompt) > 4 * PAGE + 1
    cold = last_logits(runner, prompt, 0)
    for split in (PAGE, 4 * PAGE):
        assert np.array_equal(last_logits(make(exact=True), prompt, split), cold), split


def test_normal_mode_sees_the_difference() -> None:
    runner = make(exact=False)
    assert isinstance(runner, TorchRunner)
    if runner.prompt_min_rows is None:
        pytest.fail("this CPU's default has no dense prompt path: the control needs one")
    prompt = runner.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(prompt) - 4 * PAGE < runner.prompt_min_rows <= len(prompt)  # dense cold, blocks warm
    cold = last_logits(runner, prompt, 0)
    warm = last_logits(make(exact=False), prompt, 4 * PAGE)
    assert not np.array_equal(warm, cold)
    assert warm.argmax() == cold.argmax()
