"""The "triton" op set (``kvpark.model.ops.triton_ops``) driving the real model: the same logits and
K/V as the default ops (Llama, and Qwen3 with biases), and a sequence's logits bitwise the same
alone or in a batch."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from kvpark.model.llama import LlamaModel
from kvpark.model.ops import KVCache, OpSet
from kvpark.model.ops.metadata import AttentionMetadata
from kvpark.model.ops.triton_ops import triton_ops
from support.kernels import scatter, step
from support.tiny_model import DEVICE, tiny_model


def model_step(
    model: LlamaModel, ops: OpSet, kv: KVCache, seqs: list[tuple[list[int], list[int]]]
) -> torch.Tensor:
    """One forward. seqs: (this step's tokens, the sequence's cells after it); all rows' logits."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for toks, cells in seqs:
        tokens += toks
        positions += range(len(cells) - len(toks), len(cells))
        slots += cells[len(cells) - len(toks) :]
    index, _, _ = step([cells for _, cells in seqs], [len(t) for t, _ in seqs])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        query_start=[0, *accumulate(len(t) for t, _ in seqs)],
        context_lens=[len(cells) for _, cells in seqs],
        cell_index=index,
        max_query_len=max(len(t) for t, _ in seqs),
    )
    ids = torch.tensor(tokens, device=DEVICE)
    rows = torch.arange(len(tokens), device=DEVICE)
    return model(ids, torch.tensor(positions, device=DEVICE), meta, kv, rows, ops)


@pytest.mark.parametrize("variant", ["llama", "qwen3 with biases"])
def test_triton_ops_run_the_model_like_the_default_ops(variant: str) -> None:
    extra = (
        {} if variant == "llama" else dict(arch="qwen3", qk_norm=True, qkv_bias=True, o_bias=True)
    )
    model = tiny_model(**extra)
    ops = triton_ops()
    assert ops.name == "triton exact" and ops.row_invariant and triton_ops() is ops
    (a, b), n_pages = scatter([7, 4], 4, seed=3)
    tokens = torch.randint(0, 128, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    ta, tb = tokens[:7], tokens[7:]
    steps = [
        [(ta[:6], a[:6]), (tb[:3], b[:3])],  # two prompts
        [(ta[6:], a), (tb[3:], b)],  # a decode row each
    ]
    kv = {name: KVCache.allocate(model.arch, n_pages, 4, torch.float32, DEVICE) for name in "dt"}
    for seqs in steps:
        want = model_step(model, OpSet.default(), kv["d"], seqs)
        got = model_step(model, ops, kv["t"], seqs)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip([*kv["t"].k, *kv["t"].v], [*kv["d"].k, *kv["d"].v], strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_triton_ops_give_a_sequence_the_same_logits_alone_or_in_a_batch() -> None:
    model = tiny_model()
    (a, b), n_pages = scatter([6, 10], 4, seed=4)
    tokens = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    ta, tb = tokens[:6], tokens[6:]
    alone_kv, batch_kv = (
        KVCache.allocate(model.arch, n_pages, 4, torch.float32, DEVICE) for _ in range(2)
    )
    ops = triton_ops()
    alone = model_step(model, ops, alone_kv, [(ta[:5], a[:5])])  # A's prompt
    batch = model_step(model, ops, batch_kv, [(tb[:9], b[:9]), (ta[:5], a[:5])])  # after B's
    assert torch.equal(alone, batch[9:])
    alone = model_step(model, ops, alone_kv, [(ta[5:], a)])  # A decodes, alone or beside B
    batch = model_step(model, ops, batch_kv, [(ta[5:], a), (tb[9:], b)])
    assert torch.equal(alone, batch[:1])
