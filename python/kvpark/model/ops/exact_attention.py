"""Exact mode's attention: every row of a step computed on its own, one code path for prompt and
decode rows (docs/exact.md).

On the CPU (float32, bfloat16 or float16 pools), each row is one entry of the Rust kernel
(``cpu_attention``): a row at position ``p`` reads its sequence's first ``p + 1`` cells in place,
with a per-entry arithmetic that no other row, no thread split and no chunk cut can change.
Elsewhere (CUDA without the Triton set) the torch ``chunked_attention`` keeps
the same promise with fixed query tiles and key chunks. The two paths give different bits from each
other; one runner uses one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvpark.model.ops import chunked_attention, cpu_attention
from kvpark.model.ops.chunked_attention import ChunkedPlan
from kvpark.model.ops.cpu_attention import NativeDecode
from kvpark.model.ops.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kvpark.model.arch import ModelArch


def prepare(
    meta: AttentionMetadata, arch: ModelArch, dtype: torch.dtype
) -> NativeDecode | ChunkedPlan:
    """The step's plan: native rows on the CPU's pools, chunk tiles otherwise."""
    if cpu_attention.usable(meta.cell_index.device, dtype):
        return cpu_attention.plan_rows(meta)
    return chunked_attention.prepare(meta, arch, dtype)


def exact_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: NativeDecode | ChunkedPlan
) -> torch.Tensor:
    """q [T, heads, D] (rope applied) against k_cache, v_cache [pages, page_size, kv_heads, D]
    (this step's rows already stored) -> [T, heads, D], each row independent of the others."""
    if isinstance(plan, ChunkedPlan):
        return chunked_attention.chunked_attention(q, k_cache, v_cache, plan)
    q = q.contiguous()
    out = torch.empty_like(q)
    cpu_attention.decode(q, k_cache, v_cache, plan, out)
    return out
