"""The Triton kernels (``kvpark.kernels``) against their torch references, the batch invariance
exact mode needs from them, and the "triton" op set driving the real model.

Without an NVIDIA GPU, conftest.py sets TRITON_INTERPRET=1 and every kernel runs on CPU tensors in
Triton's interpreter, one numpy call per op per program: shapes stay tiny (tens of programs, a few
loop steps). The interpreter checks indexing, masking and the structure of each reduction, not a
GPU's bits; the tests marked ``gpu`` add real sizes where CUDA is present. Bits are
compared inside one process ("alone" against "in a batch"), never against stored values.
"""

from __future__ import annotations

import random
from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F

from kvpark.kernels import matmul, paged_attention, rms_norm, store_kv
from kvpark.model.llama import LlamaModel
from kvpark.model.ops import KVCache, OpSet
from kvpark.model.ops.metadata import AttentionMetadata
from kvpark.model.ops.triton_ops import triton_ops
from support.tiny_model import DEVICE, INTERPRET, tiny_model

needs_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA (not the interpreter)")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) against an fp32/fp64 reference: bf16 gets 2 ulps, as the interpreter truncates
# fp32 -> bf16 instead of rounding, and a norm rounds twice.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2**-10), torch.bfloat16: (2e-2, 2**-6)}


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEVICE, dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol)


# ---- store_kv ----


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_exactly_the_slots(dtype: torch.dtype) -> None:
    n_pages, page_size, n_kv, head_dim, n_rows = 6, 4, 3, 12, 9  # 3 x 12: both dims masked
    caches = [randn(n_pages, page_size, n_kv, head_dim, dtype=dtype, seed=s) for s in (1, 2)]
    slots = torch.randperm(n_pages * page_size, generator=torch.Generator().manual_seed(0))
    slots = slots[:n_rows].to(DEVICE)
    qkv = randn(n_rows, 3 * n_kv, head_dim, dtype=dtype, seed=3)  # K, V as the model's views
    k, v = qkv[:, n_kv : 2 * n_kv], qkv[:, 2 * n_kv :]
    want = [c.clone() for c in caches]
    store_kv.store_kv_reference(*want, slots, k, v)
    store_kv.store_kv(*caches, slots, k, v)
    for got, expected in zip(caches, want, strict=True):
        assert torch.equal(got, expected)
    flat_k = caches[0].view(-1, n_kv, head_dim)
    assert torch.equal(flat_k[slots], k) and not torch.equal(flat_k[slots], v)


def test_store_kv_rejects_what_it_cannot_store() -> None:
    k_cache, v_cache = randn(2, 4, 2, 8), randn(2, 4, 2, 8)
    k = v = randn(3, 2, 8)
    with pytest.raises(ValueError, match="does not fit"):
        store_kv.store_kv(k_cache, v_cache, torch.arange(3, device=DEVICE), k.half(), v)
    with pytest.raises(ValueError, match="int64"):
        store_kv.store_kv(k_cache, v_cache, torch.arange(3, device=DEVICE).int(), k, v)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="outside the pool"):
            store_kv.store_kv(k_cache, v_cache, torch.tensor([0, 1, 8]), k, v)


# ---- rms_norm ----


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    x = randn(5, 3, 40, dtype=dtype)  # leading dims flattened; d = 40 masks a block of 64
    w = randn(40, dtype=dtype, seed=1)
    got = rms_norm.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:
        want = F.rms_norm(x, (40,), w, 1e-6)
    else:  # kvpark.model.ops.norm's order: normalise in fp32, round, then scale
        want = (F.rms_norm(x.float(), (40,), None, 1e-6).to(dtype) * w).float()
    assert_close(got, want, dtype)
    assert_close(rms_norm.rms_norm_reference(x, w, 1e-6), want, dtype)
    # Rows are independent: one row alone gives the same bits, and so does a strided view.
    assert torch.equal(rms_norm.rms_norm(x[2:3, 1], w, 1e-6), got[2:3, 1])
    fused = randn(4, 6, 40, dtype=dtype, seed=2)  # per-head slices of a QKV projection (Qwen3)
    heads = fused[:, 1:4]
    assert torch.equal(rms_norm.rms_norm(heads, w, 1e-6), rms_norm.rms_norm(heads.clone(), w, 1e-6))


# ---- matmul ----


def test_matmul_reduces_by_sum_exactly_when_interpreted() -> None:
    assert matmul.DOT_BY_SUM is INTERPRET  # tl.dot on a GPU; see kernels/matmul.py


@pytest.mark.parametrize("by_sum", [False, True] if INTERPRET else [False])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_matches_reference(
    dtype: torch.dtype, with_bias: bool, by_sum: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(matmul, "DOT_BY_SUM", by_sum)  # the tl.dot path, too, where interpreted
    # 37 x 70 x 72: no dimension a multiple of its block (32, 64, 32), so every edge is masked
    wide = randn(37, 80, dtype=dtype)
    x = wide[:, :72]  # a row stride that is not K
    w = randn(70, 72, dtype=dtype, seed=1) / 72**0.5
    bias = randn(70, dtype=dtype, seed=2) if with_bias else None
    got = matmul.matmul(x, w, bias)
    assert got.shape == (37, 70) and got.dtype == dtype
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert_close(got, want, dtype)
    assert_close(matmul.matmul_reference(x, w, bias), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_row_is_bitwise_the_same_whatever_the_batch(dtype: torch.dtype) -> None:
    w = randn(40, 48, dtype=dtype, seed=1)
    bias = randn(40, dtype=dtype, seed=2)
    row = randn(1, 48, dtype=dtype, seed=3)
    alone = matmul.matmul(row, w, bias)
    for m in (2, 3, 17, 33):
        for at in sorted({0, 1, m // 2, m - 1}):  # 33 - 1 = 32: the first row of a second tile
            x = randn(m, 48, dtype=dtype, seed=m)
            x[at] = row[0]
            assert torch.equal(matmul.matmul(x, w, bias)[at], alone[0]), (m, at)


def test_matmul_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="not \\[M, K\\]"):
        matmul.matmul(randn(3, 8), randn(4, 9))
    with pytest.raises(ValueError, match="contiguous along K"):
        matmul.matmul(randn(8, 3).t(), randn(4, 8))


# ---- paged attention ----

N_HEADS, N_KV, HEAD_DIM = 4, 2, 24  # GQA group of 2; D = 24 masks a block of 32


def scatter(lengths: list[int], page_size: int, seed: int) -> tuple[list[list[int]], int]:
    """Cells for sequences of these lengths on shuffled pages (a page or two left unused)."""
    n_pages = sum(-(-n // page_size) for n in lengths) + 2
    pages = list(range(n_pages))
    random.Random(seed).shuffle(pages)
    cells = []
    for n in lengths:
        table = [pages.pop() for _ in range(-(-n // page_size))]
        cells.append([table[p // page_size] * page_size + p % page_size for p in range(n)])
    return cells, n_pages


def attend(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    cells: list[list[int]],
    rows: list[int],
    key_chunk: int = paged_attention.KEY_CHUNK,
) -> torch.Tensor:
    """Sequence b owns the next rows[b] rows of q, its last positions over its cells[b]."""
    return paged_attention.paged_attention(q, *caches, *step(cells, rows), key_chunk=key_chunk)


def step(cells: list[list[int]], rows: list[int]) -> tuple[torch.Tensor, ...]:
    """cell_index [B, longest] (0-padded), row_seq, row_pos for a step."""
    index = torch.zeros(len(cells), max(map(len, cells)), dtype=torch.int64)
    for b, c in enumerate(cells):
        index[b, : len(c)] = torch.tensor(c)
    starts = [0, *accumulate(rows)]
    row_seq, row_pos = paged_attention.step_rows(starts, [len(c) for c in cells], DEVICE)
    return index.to(DEVICE), row_seq, row_pos


def reference64(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    cells: list[list[int]],
    rows: list[int],
) -> torch.Tensor:
    """Row by row in float64 from the cell lists alone (no cell_index, no step_rows)."""
    k_flat, v_flat = (c.view(-1, N_KV, HEAD_DIM).double().cpu() for c in caches)
    out = torch.empty(q.shape, dtype=torch.float64)
    r = 0
    for seq_cells, n in zip(cells, rows, strict=True):
        for i in range(n):
            idx = torch.tensor(seq_cells[: len(seq_cells) - n + i + 1])
            k = k_flat[idx].repeat_interleave(N_HEADS // N_KV, dim=1)  # [L, heads, D]
            v = v_flat[idx].repeat_interleave(N_HEADS // N_KV, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[r].double().cpu(), k) / HEAD_DIM**0.5
            out[r] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
            r += 1
    return out


def pool(n_pages: int, page_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches full of random values: stale cells must be masked, not merely zero."""
    shape = (n_pages, page_size, N_KV, HEAD_DIM)
    return randn(*shape, dtype=dtype, seed=11), randn(*shape, dtype=dtype, seed=12)


# (rows this step, context after it): a 1-cell prompt, a 5-row prompt, a decode row at 16, and a
# prompt chunk of 8 rows at positions 62..69, across the edge of the first 64-cell key chunk.
MIXED = [(1, 1), (5, 5), (1, 17), (8, 70)]


@pytest.mark.parametrize("page_size", [4, 8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_matches_reference(dtype: torch.dtype, page_size: int) -> None:
    rows = [n for n, _ in MIXED]
    cells, n_pages = scatter([ctx for _, ctx in MIXED], page_size, seed=page_size)
    caches = pool(n_pages, page_size, dtype)
    q = randn(sum(rows), N_HEADS, HEAD_DIM, dtype=dtype, seed=5)
    got = attend(q, caches, cells, rows)
    assert got.shape == q.shape and got.dtype == dtype
    want = reference64(q, caches, cells, rows)
    assert_close(got.cpu(), want, dtype)
    torch_ref = paged_attention.paged_attention_reference(q, *caches, *step(cells, rows))
    assert_close(torch_ref.cpu(), want, dtype)


def test_step_rows_names_each_rows_sequence_and_position() -> None:
    row_seq, row_pos = paged_attention.step_rows([0, 1, 4, 5], [1, 7, 9], "cpu")
    assert row_seq.tolist() == [0, 1, 1, 1, 2] and row_pos.tolist() == [0, 4, 5, 6, 8]
    assert row_seq.dtype == row_pos.dtype == torch.int32
    with pytest.raises(ValueError, match="3 rows for a context of 2"):
        paged_attention.step_rows([0, 3], [2], "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_sequence_alone_equals_in_a_batch(dtype: torch.dtype) -> None:
    rows = [n for n, _ in MIXED]
    cells, n_pages = scatter([ctx for _, ctx in MIXED], 8, seed=1)
    caches = pool(n_pages, 8, dtype)
    q = randn(sum(rows), N_HEADS, HEAD_DIM, dtype=dtype, seed=6)
    batch = attend(q, caches, cells, rows)
    starts = [0, *accumulate(rows)]
    for b in range(len(rows)):
        mine = slice(starts[b], starts[b + 1])
        alone = attend(q[mine], caches, [cells[b]], [rows[b]])  # a narrower cell_index too
        assert torch.equal(alone, batch[mine]), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_prompt_row_equals_decode_row(dtype: torch.dtype) -> None:
    # A whole 17-row prompt over 16-cell key chunks, and a 6-row chunk at 61..66 over 64-cell ones.
    for length, n_rows, key_chunk in ((17, 17, 16), (67, 6, 64)):
        (cells,), n_pages = scatter([length], 4, seed=length)
        caches = pool(n_pages, 4, dtype)
        q = randn(n_rows, N_HEADS, HEAD_DIM, dtype=dtype, seed=length)
        prompt = attend(q, caches, [cells], [n_rows], key_chunk)
        first = length - n_rows
        for i in sorted({0, 1, n_rows // 2, n_rows - 2, n_rows - 1}):
            t = first + i  # decode row at position t: attends to cells 0..t only
            decode = attend(q[i : i + 1], caches, [cells[: t + 1]], [1], key_chunk)
            assert torch.equal(decode[0], prompt[i]), (length, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_prompt_in_two_chunks_equals_at_once(dtype: torch.dtype) -> None:
    for length, n_rows, split, key_chunk in ((17, 17, 9, 16), (70, 12, 6, 64)):
        (cells,), n_pages = scatter([length], 8, seed=length)
        caches = pool(n_pages, 8, dtype)
        q = randn(n_rows, N_HEADS, HEAD_DIM, dtype=dtype, seed=length)
        once = attend(q, caches, [cells], [n_rows], key_chunk)
        end_first = length - n_rows + split  # the first chunk's context ends before the second's
        first = attend(q[:split], caches, [cells[:end_first]], [split], key_chunk)
        second = attend(q[split:], caches, [cells], [n_rows - split], key_chunk)
        assert torch.equal(torch.cat([first, second]), once), length


def test_paged_attention_rejects_bad_inputs() -> None:
    caches = pool(2, 4, torch.float32)
    q = randn(2, 3, HEAD_DIM)  # 3 heads over 2 KV heads
    row = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    index = torch.zeros(1, 8, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention.paged_attention(q, *caches, index, row, row)
    q = randn(2, N_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="int32"):
        paged_attention.paged_attention(q, *caches, index, row.long(), row)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention.paged_attention(q, *caches, index, row, row, key_chunk=48)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="beyond cell_index"):
            paged_attention.paged_attention(q, *caches, index, row, row + 8)


# ---- the "triton" op set in the real model ----


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


# ---- real sizes, on a GPU only ----


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matmul_real_sizes_are_close_and_batch_invariant(dtype: torch.dtype) -> None:
    w = randn(3000, 2048, dtype=dtype, seed=1) / 2048**0.5  # N not a multiple of BLOCK_N
    bias = randn(3000, dtype=dtype, seed=2)
    row = randn(1, 2048, dtype=dtype, seed=3)
    alone = matmul.matmul(row, w, bias)
    for m in (2, 7, 64, 333, 1024):
        x = randn(m, 2048, dtype=dtype, seed=m)
        for at in sorted({0, 5 % m, m // 2, m - 1}):
            x[at] = row[0]
            got = matmul.matmul(x, w, bias)
            assert torch.equal(got[at], alone[0]), (m, at)
        atol = 1e-3 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, matmul.matmul_reference(x, w, bias), atol=atol, rtol=1e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_paged_attention_real_sizes(dtype: torch.dtype) -> None:
    n_heads, n_kv, head_dim, page_size = 32, 8, 128, 16
    lens = [(1, 1500), (64, 64), (1, 65), (20, 900)]
    cells, n_pages = scatter([ctx for _, ctx in lens], page_size, seed=7)
    shape = (n_pages, page_size, n_kv, head_dim)
    caches = randn(*shape, dtype=dtype, seed=1), randn(*shape, dtype=dtype, seed=2)
    rows = [n for n, _ in lens]
    q = randn(sum(rows), n_heads, head_dim, dtype=dtype, seed=3)
    batch = attend(q, caches, cells, rows)
    starts = [0, *accumulate(rows)]
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    for b in range(len(rows)):
        mine = slice(starts[b], starts[b + 1])
        alone = attend(q[mine], caches, [cells[b]], [rows[b]])
        assert torch.equal(alone, batch[mine]), b
        want = paged_attention.paged_attention_reference(
            q[mine], *caches, *step([cells[b]], [rows[b]])
        )
        torch.testing.assert_close(alone, want, atol=atol, rtol=1e-2)
    for i in (0, 31, 63):  # prompt rows of sequence 1 as decode rows
        decode = attend(q[1 + i : 2 + i], caches, [cells[1][: i + 1]], [1])
        assert torch.equal(decode[0], batch[1 + i])
