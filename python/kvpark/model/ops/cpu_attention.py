"""Decode attention on the CPU read in place from the paged pool (``rust/cpu_ops``).

The torch path (``attention.py``) gathers every decode sequence's cells into a padded batch with
``index_select`` and then runs SDPA: at 8 decoding chats that gather was the largest op of a
step. The Rust kernel reads each cell's K and V where it lies, through the sequence's cell list,
for all decode rows of a step in one call, split over the CPU kernel threads. Prompt rows keep the
torch path. Float32, bfloat16 and float16 pools (a 16-bit value is widened exactly where it is
read); ``attention.prepare`` picks this path by itself. Exact mode sends
every row through it, prompt rows as entries of their own (``plan_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvpark._core as _core
from kvpark.model.ops.metadata import AttentionMetadata

Tensor = torch.Tensor
# the cells the kernel reads (16-bit ones widened exactly), each with the binding's code for it
POOL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class NativeDecode:
    """The decode sequences of a step, for one kernel call per layer."""

    cells: Tensor  # [B, L] int64, each sequence's cells in logical order (0-padded)
    context: Tensor  # [B] int64
    rows: Tensor  # [B] int64: each sequence's row in the step


def usable(device: torch.device, kv_dtype: torch.dtype) -> bool:
    return device.type == "cpu" and kv_dtype in POOL_DTYPES


def plan(cell_index: Tensor, seqs: list[int], context: list[int], rows: list[int]) -> NativeDecode:
    cells = cell_index if len(seqs) == cell_index.shape[0] else cell_index[seqs]
    width = max(context)
    return NativeDecode(
        cells=cells[:, :width].to(torch.int64).contiguous(),
        context=torch.tensor(context, dtype=torch.int64),
        rows=torch.tensor(rows, dtype=torch.int64),
    )


def plan_rows(meta: AttentionMetadata) -> NativeDecode:
    """Every row of a step as its own entry, prompt rows included: a row at position ``p`` of its
    sequence attends to the sequence's first ``p + 1`` cells. The kernel's arithmetic for an entry
    depends only on its query and those cells, so a prompt row gets the bits it would get as a
    decode step (exact mode's attention on the CPU, ``exact_attention.py``)."""
    seq_of_row: list[int] = []
    context: list[int] = []
    for b in range(meta.n_seqs):
        first, last = meta.query_start[b], meta.query_start[b + 1]
        start = meta.context_lens[b] - (last - first)
        if last <= first or start < 0:
            raise ValueError(f"bad step: sequence {b} has rows {first}..{last}")
        seq_of_row += [b] * (last - first)
        context += range(start + 1, meta.context_lens[b] + 1)
    width = max(context)
    cells = meta.cell_index[:, :width].to(torch.int64)
    if meta.n_rows != meta.n_seqs:  # a prompt's rows share its cell list
        cells = cells.index_select(0, torch.tensor(seq_of_row, dtype=torch.int64))
    return NativeDecode(
        cells=cells.contiguous(),
        context=torch.tensor(context, dtype=torch.int64),
        rows=torch.arange(meta.n_rows, dtype=torch.int64),
    )


def decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, p: NativeDecode, out: Tensor) -> None:
    """out[rows] = attention of q[rows] [T, heads, D] over each sequence's cells of k_cache,
    v_cache [pages, page_size, kv_heads, D]; the other rows of ``out`` are left alone. The kernel
    computes in float32: queries of another dtype (a bf16 or f16 model) are widened, each row on its
    own, and its rows of ``out`` rounded back."""
    if q.dtype != torch.float32:
        wide = out.float()
        decode(q.float(), k_cache, v_cache, p, wide)
        out.index_copy_(0, p.rows, wide.index_select(0, p.rows).to(out.dtype))
        return
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    for t in (q, k_cache, v_cache, out):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("CPU decode attention takes contiguous CPU tensors")
    kv_dtype = k_cache.dtype
    if out.dtype != torch.float32 or v_cache.dtype != kv_dtype:
        raise ValueError("CPU decode attention takes float32 queries and one K/V dtype")
    if kv_dtype not in POOL_DTYPES:
        raise ValueError(
            f"CPU decode attention reads float32, bfloat16 or float16 pools, not {kv_dtype}"
        )
    if out.shape != q.shape or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"shapes q {tuple(q.shape)}, K {tuple(k_cache.shape)} do not fit")
    _core._decode_attention(
        q.data_ptr(),
        q.numel(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.numel(),
        POOL_DTYPES[kv_dtype],
        p.cells.data_ptr(),
        p.cells.shape[0],
        p.cells.shape[1],
        p.context.data_ptr(),
        p.rows.data_ptr(),
        heads,
        kv_heads,
        head_dim,
        out.data_ptr(),
    )
