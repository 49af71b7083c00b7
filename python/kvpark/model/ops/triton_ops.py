"""The "triton" op set: every op of ``llama.py`` on the Triton kernels of ``kvpark.kernels``.

| op                | runs                                                           |
|-------------------|----------------------------------------------------------------|
| linear            | ``kernels/matmul.py``: fixed tiles, no split-K, batch invariant |
| rms_norm          | ``kernels/rms_norm.py``: one program per row                    |
| rope              | the torch ``kvpark.model.ops.rope.apply_rope`` (elementwise, row-wise) |
| store_kv          | ``kernels/store_kv.py``                                         |
| prepare_attention | per-row sequence and position tensors, built once per step     |
| attention         | ``kernels/paged_attention.py``: one program per (row, KV head) |

Every op's result for a row depends only on that row (and, for attention, its sequence's cells),
so a step's outputs do not change with the batch around them. Meant for CUDA; on CPU it runs only
under ``TRITON_INTERPRET=1`` (the tests). The kernels are imported when the op set is built, not
when this module is, so ``import kvpark`` works without triton.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

from kvpark.model.ops import OpSet, with_blocks
from kvpark.model.ops.linear import linear
from kvpark.model.ops.metadata import AttentionMetadata
from kvpark.model.ops.rope import apply_rope

if TYPE_CHECKING:
    from kvpark.model.arch import ModelArch


@dataclass(frozen=True)
class TritonAttentionPlan:
    """One step's attention inputs besides q and the caches, shared by every layer."""

    cell_index: torch.Tensor  # [B, W] int64: each sequence's cells in logical order
    row_seq: torch.Tensor  # [T] int32: the sequence of each row
    row_pos: torch.Tensor  # [T] int32: the position of each row


@cache
def triton_ops() -> OpSet:
    """The op set, built (and the kernels imported) on first use."""
    from kvpark.kernels import matmul, paged_attention, rms_norm, store_kv

    def prepare(meta: AttentionMetadata, arch: ModelArch, dtype: torch.dtype) -> Any:
        device = meta.cell_index.device
        row_seq, row_pos = paged_attention.step_rows(meta.query_start, meta.context_lens, device)
        return TritonAttentionPlan(meta.cell_index.contiguous(), row_seq, row_pos)

    def attention(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Any
    ) -> torch.Tensor:
        p: TritonAttentionPlan = plan
        return paged_attention.paged_attention(  # type: ignore[no-any-return]
            q, k_cache, v_cache, p.cell_index, p.row_seq, p.row_pos
        )

    return OpSet(
        name="triton exact",
        row_invariant=True,
        linear=with_blocks(matmul.matmul),
        rms_norm=rms_norm.rms_norm,
        rope=apply_rope,
        store_kv=store_kv.store_kv,
        prepare_attention=prepare,
        attention=attention,
    )


@cache
def cuda_ops() -> OpSet:
    """Normal mode on CUDA: cuBLAS matmuls (fast, not batch invariant), the kernels for the rest."""
    return replace(triton_ops(), name="triton", row_invariant=False, linear=with_blocks(linear))
