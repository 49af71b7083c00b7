"""``--tensor-parallel 2`` at the runner: rank 0 in this process, rank 1 a gloo worker it spawns
on 127.0.0.1, over a tiny Llama whose heads divide (support/tiny_tp.py), in exact mode, one
thread a rank.

The bound (tests/support/lean_reference.py derives it for one process): every op of the forward is
within gamma_k of its exact result relative to the magnitudes it sums, k its longest sum. Two
ranks evaluate the same expression with the long sums of O and down grouped otherwise (each
rank's partial sum over its heads or its MLP slice, then the all-reduce adds the two: still a
sum of at most k terms, the output bias one of them as before) and the embedding and the head
looked up and multiplied per vocabulary slice (no sum crosses a slice), so the same
``budget`` bounds each logit's distance from the float64 forward, and two forwards of one rank
and of two are within twice it. Exact mode's bits hold per TP size: alone or beside others,
chunked or not, parked by swap and restored on every rank, a row's logits are the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvpark.model.numpy_weights import read_model
from kvpark.model.weight_arrays import NumpyWeights
from kvpark.runner.torch_runner import TorchRunner
from kvpark.runner.tp_runner import TpRunner
from kvpark.sched.plan import StepItem, StepPlan
from support import lean_reference as ref
from support.tiny_tp import PAGE, config, save_tiny_tp

PROMPTS = [ref.PROMPT, [101, 7, 7, 250, 3000, 41, 9, 12, 600, 5, 44]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_tp(tmp_path_factory.mktemp("tiny-tp"))


@pytest.fixture(scope="module")
def tp2(model_dir: str) -> Iterator[TpRunner]:
    runner = TpRunner(config(model_dir, 2))
    try:
        yield runner
    finally:
        runner.close()
    assert [w.returncode for w in runner.group.workers] == [0]  # stopped, not killed


@pytest.fixture(scope="module")
def tp1(model_dir: str) -> TorchRunner:
    c = config(model_dir, 1)
    return TorchRunner(c.model, c.pool)


@pytest.fixture(scope="module")
def weights(model_dir: str) -> NumpyWeights:
    return read_model(model_dir)[0]


def test_two_ranks_hold_half_the_heads_and_half_of_every_cell(
    tp2: TpRunner, tp1: TorchRunner
) -> None:
    assert tp2.shard.model.arch.n_heads == 4 and tp2.shard.model.arch.n_kv_heads == 1
    assert tp2.vocab_size == tp1.vocab_size and tp2.row_invariant
    assert tp2.shard.kv.bytes_per_cell() * 2 == tp1.kv.bytes_per_cell() == tp2.bytes_per_cell()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_one_rank_and_logits_are_within_the_derived_bound(
    tp2: TpRunner, tp1: TorchRunner, weights: NumpyWeights, prompt: list[int]
) -> None:
    seq, got = ref.greedy(tp2, prompt)  # type: ignore[arg-type]
    one_seq, one = ref.greedy(tp1, prompt)  # type: ignore[arg-type]
    assert seq == one_seq
    first = len(prompt) // 2 - 1
    hidden, logits = ref.reference(weights, seq[:-1])
    bound = ref.budget(weights, len(seq)) * (
        np.abs(hidden[first:]) @ np.abs(ref.exact(weights.head)).T
    )
    assert np.all(np.abs(got - logits[first:]) <= bound)
    assert np.all(np.abs(got - one) <= 2 * bound)
    assert np.abs(logits).max() > 100 * bound.max()  # real logits, a tight bound
    # where the float64 forward's top two are further apart than the bound allows either
    # forward to move them, both picks are its pick; most steps are such (not a vacuous check)
    top2 = np.sort(logits[first:], axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0] > 2 * bound.max(axis=-1))[len(prompt) - 1 - first :]
    assert clear.sum() >= ref.NEW // 2
    best = logits[len(prompt) - 1 :].argmax(-1)
    assert np.array_equal(np.array(seq[len(prompt) :])[clear], best[clear])


def test_exact_mode_bits_whatever_the_neighbours_and_the_chunking(tp2: TpRunner) -> None:
    alone, beside = ref.alone_and_beside_others(tp2)  # type: ignore[arg-type]
    again, _ = ref.alone_and_beside_others(tp2)  # type: ignore[arg-type]
    assert torch.equal(torch.as_tensor(alone), torch.as_tensor(beside))
    assert torch.equal(torch.as_tensor(alone), torch.as_tensor(again))


def _step(r: TpRunner, table: list[int], start: int, tokens: list[int]) -> torch.Tensor:
    cells = [table[p // PAGE] * PAGE + p % PAGE for p in range(start, start + len(tokens))]
    logits: torch.Tensor = r.execute(StepPlan([StepItem(0, start, tokens, True)], cells, [table]))
    return logits[0]


def test_a_swap_park_moves_every_ranks_share_and_comes_back_bit_for_bit(tp2: TpRunner) -> None:
    prompt = PROMPTS[1]
    here, there = [0, 1], [9, 4]  # a resume gets other pages
    _step(tp2, here, 0, prompt)
    want = _step(tp2, here, len(prompt), [17])
    buf = tp2.host_buffer(len(prompt) * tp2.bytes_per_cell())
    assert buf.nbytes == len(prompt) * tp2.bytes_per_cell()
    tp2.save_cells(list(range(len(prompt))), buf)
    for page in here:  # another sequence overwrites the cells the park freed, on both ranks
        _step(tp2, [page], 0, [5] * PAGE)
    cells = [p * PAGE + i for p in there for i in range(PAGE)][: len(prompt)]
    tp2.restore_cells(buf, cells)
    assert torch.equal(_step(tp2, there, len(prompt), [17]), want)
    freed = buf.id
    del buf  # rank 0's share goes with it; rank 1 drops its own at the next command
    assert tp2._frees == [freed]
    _step(tp2, there, len(prompt), [17])
    assert tp2._frees == []


def test_refused_at_start_the_default_models_heads_do_not_divide() -> None:
    with pytest.raises(ValueError, match="9 query heads and 3 KV heads do not both divide by 2"):
        TpRunner(config(None, 2))  # type: ignore[arg-type]
