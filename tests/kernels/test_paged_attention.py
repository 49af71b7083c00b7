"""The ``paged_attention`` kernel against a float64 reference over scattered pages, in each dtype
and page size; the batch invariance exact mode needs from it (a sequence alone or in a batch, a
prompt row or a decode row, a prompt in one chunk or two: the same bits); ``step_rows``; its
refusals; and, on a GPU only, real sizes."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from kvpark.kernels import paged_attention
from support.kernels import DTYPES, assert_close, needs_cuda, randn, scatter, step
from support.tiny_model import DEVICE

N_HEADS, N_KV, HEAD_DIM = 4, 2, 24  # GQA group of 2; D = 24 masks a block of 32


def attend(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    cells: list[list[int]],
    rows: list[int],
    key_chunk: int = paged_attention.KEY_CHUNK,
) -> torch.Tensor:
    """Sequence b owns the next rows[b] rows of q, its last positions over its cells[b]."""
    return paged_attention.paged_attention(q, *caches, *step(cells, rows), key_chunk=key_chunk)


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
