"""Causal attention over the paged KV pool: prompt rows and decode rows in ONE code path.

```
q           [T, n_heads, D]        this step's rows, rope applied
k_cache     [n_cells, kv_heads, D] (v_cache the same; [pages, page_size, ...] viewed flat)
cell_index  [B, W]                 each sequence's cells in logical order (position p -> cell)
row_seq     [T] int32              the sequence a row belongs to
row_pos     [T] int32              its position: it attends to cells 0..row_pos of its sequence

grid (T, kv_heads): one program = one query row x the `group` query heads of one KV head
    for chunk in 0 .. row_pos // KEY_CHUNK:          keys in logical order, KEY_CHUNK at a time
        cells  = cell_index[seq, chunk]              gather K, V rows of the chunk's cells
        scores = q @ K.T * scale, -inf past row_pos
        online softmax update (running max m, sum l, fp32 accumulator)
    out = acc / l
```
Why this shape gives batch invariance (exact mode): a program reads nothing but its row's
q and its sequence's cells, and its loop (number of chunks, their boundaries, every reduction's
shape) depends only on the row's position. So a row gets the same bits alone or in any batch, as a
decode row or inside a prompt, in one prompt chunk or in two. There is no split-K combine and no
query tile shared between rows. A chunk past the row's position is never visited, and one that
were would leave the running state unchanged: its scores are all -inf, so m stays, alpha is
exp(0) = 1 and p is 0.

The price: a prompt of n rows reads its cells n times (from L2 on a GPU) and a GQA group is
padded to at least 16 query heads for ``tl.dot``. Loads are upcast to fp32 before ``tl.dot``: the
interpreter multiplies bf16 bit patterns otherwise, and half types are exact in
tf32, so the products lose nothing on a GPU either.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

KEY_CHUNK = 64  # cells per online-softmax step; a power of two, at least 16 for tl.dot


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, n_heads, D], strides (stride_qt, stride_qh, 1)
    k_cache_ptr,  # [n_cells, kv_heads, D] contiguous
    v_cache_ptr,  # [n_cells, kv_heads, D] contiguous
    cell_index_ptr,  # [B, W] int32 or int64, strides (stride_cb, 1)
    row_seq_ptr,  # [T] int32
    row_pos_ptr,  # [T] int32
    out_ptr,  # [T, n_heads, D] contiguous
    stride_qt,
    stride_qh,
    stride_cb,
    n_kv_heads,
    head_dim,
    group,  # query heads per KV head
    scale,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KEY_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs; "tf32" is exact for upcast half types
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq = tl.load(row_seq_ptr + row).to(tl.int64)
    pos = tl.load(row_pos_ptr + row)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    c = tl.arange(0, KEY_CHUNK)
    d_ok = d < head_dim
    gd_ok = (g < group)[:, None] & d_ok[None, :]
    heads = kv_head * group + g  # query heads h with h // group == kv_head
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=gd_ok, other=0.0
    ).to(tl.float32)  # [G, D]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    cells_of_seq = cell_index_ptr + seq * stride_cb
    # Chunk 0 always holds position 0, so m is finite after the first step and never -inf - -inf.
    for start in range(0, pos + 1, KEY_CHUNK):
        logical = start + c
        visible = logical <= pos  # [C]
        cell = tl.load(cells_of_seq + logical, mask=visible, other=0).to(tl.int64)
        kv_off = (cell * n_kv_heads + kv_head)[:, None] * head_dim + d[None, :]  # [C, D]
        kv_ok = visible[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)  # [C, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, C]
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)  # 0 on the first chunk, 1 where the max did not move
        p = tl.exp(s - m_new[:, None])  # exactly 0 at masked cells
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        v = tl.load(v_cache_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)  # [C, D]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    out = acc / l[:, None]
    out_off = row * group * n_kv_heads * head_dim + heads[:, None] * head_dim + d[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=gd_ok)


def step_rows(
    query_start: list[int], context_lens: list[int], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """row_seq, row_pos [T] int32 for a step whose sequence b owns rows query_start[b]:[b + 1],
    the LAST rows of its context_lens[b] positions (``kvpark.model.ops.metadata``). Built on the
    host, once per step, so no layer syncs with the device."""
    seqs: list[int] = []
    positions: list[int] = []
    for b, ctx in enumerate(context_lens):
        n = query_start[b + 1] - query_start[b]
        if not 1 <= n <= ctx:
            raise ValueError(f"sequence {b}: {n} rows for a context of {ctx}")
        seqs += [b] * n
        positions += range(ctx - n, ctx)
    return (
        torch.tensor(seqs, dtype=torch.int32, device=device),
        torch.tensor(positions, dtype=torch.int32, device=device),
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cell_index: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    key_chunk: int = KEY_CHUNK,
) -> torch.Tensor:
    """q [T, n_heads, D] against k_cache, v_cache [pages, page_size, kv_heads, D] (this step's rows
    already stored) -> [T, n_heads, D] in q's dtype. Row t attends to cells
    cell_index[row_seq[t], 0..row_pos[t]] (see ``step_rows``)."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, n_heads, D] with D contiguous, got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches must be [pages, page_size, kv_heads, D]: {k_cache.shape}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    n_rows, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or n_heads % n_kv != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {n_kv} x {k_cache.shape[3]}")
    floats = (torch.float32, torch.float16, torch.bfloat16)
    if q.dtype not in floats or k_cache.dtype not in floats:
        raise ValueError(f"unsupported dtypes q {q.dtype}, cache {k_cache.dtype}")
    if cell_index.dim() != 2 or cell_index.dtype not in (torch.int32, torch.int64):
        raise ValueError("cell_index must be [B, W] int32 or int64")
    if cell_index.stride(-1) != 1:
        raise ValueError("cell_index must be contiguous along W")
    for name, t in (("row_seq", row_seq), ("row_pos", row_pos)):
        if t.shape != (n_rows,) or t.dtype != torch.int32:
            raise ValueError(f"{name} must be [{n_rows}] int32, got {tuple(t.shape)} {t.dtype}")
    if len({t.device for t in (q, k_cache, v_cache, cell_index, row_seq, row_pos)}) != 1:
        raise ValueError("all tensors must be on one device")
    if key_chunk < 16 or key_chunk & (key_chunk - 1):
        raise ValueError(f"key_chunk {key_chunk} must be a power of two >= 16")
    if q.device.type == "cpu" and n_rows:  # bounds the kernel trusts; free to check on the host
        if int(row_seq.min()) < 0 or int(row_seq.max()) >= cell_index.shape[0]:
            raise ValueError("row_seq outside cell_index")
        if int(row_pos.min()) < 0 or int(row_pos.max()) >= cell_index.shape[1]:
            raise ValueError("row_pos beyond cell_index's width")
    out = torch.empty((n_rows, n_heads, head_dim), dtype=q.dtype, device=q.device)
    if n_rows == 0:
        return out
    group = n_heads // n_kv
    _paged_attention_kernel[(n_rows, n_kv)](
        q,
        k_cache,
        v_cache,
        cell_index,
        row_seq,
        row_pos,
        out,
        q.stride(0),
        q.stride(1),
        cell_index.stride(0),
        n_kv,
        head_dim,
        group,
        1.0 / math.sqrt(head_dim),
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        KEY_CHUNK=key_chunk,
        PRECISION="ieee" if torch.float32 in (q.dtype, k_cache.dtype) else "tf32",
    )
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cell_index: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
) -> torch.Tensor:
    """The torch definition, in fp32: each row's cells gathered whole, masked past its position,
    one softmax. Memory grows as T x W; for tests and small checks only."""
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    cells = cell_index[row_seq.long()].long()  # [T, W]
    k = k_cache.view(-1, n_kv, head_dim)[cells].float()  # [T, W, kv, D]
    v = v_cache.view(-1, n_kv, head_dim)[cells].float()
    k = k.repeat_interleave(n_heads // n_kv, dim=2)  # [T, W, heads, D]
    v = v.repeat_interleave(n_heads // n_kv, dim=2)
    scores = torch.einsum("thd,twhd->thw", q.float(), k) / math.sqrt(head_dim)
    width = torch.arange(cells.shape[1], device=q.device)
    visible = width[None, :] <= row_pos.long()[:, None]  # [T, W]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("thw,twhd->thd", scores.softmax(-1), v).to(q.dtype)


if __name__ == "__main__":
    # On CPU: TRITON_INTERPRET=1 python kernels/paged_attention.py (set before triton.jit runs).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1")
    big = device == "cuda"
    n_heads, n_kv, head_dim, page_size = (32, 8, 128, 16) if big else (4, 2, 16, 8)
    lens = [(512, 512), (1, 700), (1, 33), (40, 90)] if big else [(5, 5), (1, 70), (3, 20)]
    n_pages = sum(-(-ctx // page_size) for _, ctx in lens)
    pages = torch.randperm(n_pages).tolist()  # scattered pages
    width = max(ctx for _, ctx in lens)
    cell_index = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, (_, ctx) in enumerate(lens):
        table = [pages.pop() for _ in range(-(-ctx // page_size))]
        cell_index[b, :ctx] = torch.tensor([table[p // page_size] * page_size for p in range(ctx)])
        cell_index[b, :ctx] += torch.arange(ctx, dtype=torch.int32) % page_size
    starts = [0]
    for n, _ in lens:
        starts.append(starts[-1] + n)
    row_seq, row_pos = step_rows(starts, [ctx for _, ctx in lens], device)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        k_cache, v_cache = (
            torch.randn(n_pages, page_size, n_kv, head_dim).to(device, dtype) for _ in "kv"
        )
        q = torch.randn(starts[-1], n_heads, head_dim).to(device, dtype)
        args = (q, k_cache, v_cache, cell_index.to(device), row_seq, row_pos)
        err = (paged_attention(*args).float() - paged_attention_reference(*args).float()).abs()
        print(f"paged_attention {dtype}: max diff {err.max().item():.2e} vs reference")
        if big:
            ms = triton.testing.do_bench(lambda: paged_attention(*args))  # noqa: B023
            print(f"  {ms * 1e3:.1f} us for {starts[-1]} rows")
