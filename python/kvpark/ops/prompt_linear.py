"""Prompt chunks through a dense GEMM, the step's other rows through the block kernels.

A decode row reads every weight once, which the block kernels do in the fewest bytes; a prompt
chunk of hundreds of rows is compute-bound, where a dense GEMM (MKL float32, or oneDNN bfloat16 on
a CPU with native bf16) is faster (docs/cpu-kernels.md). A step that holds both splits each
projection by rows; a row's result depends only on that row and the path its chunk takes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvpark.ops.block_weights import BlockWeight, block_linear

Tensor = torch.Tensor


def dense_linear(x: Tensor, dense: Tensor, bias: Tensor | None) -> Tensor:
    """x [rows, in] float32 @ dense.T in dense's dtype, back to float32 (+ bias)."""
    y = F.linear(x.to(dense.dtype), dense).float()
    return y if bias is None else y.add_(bias)


def split_linear(
    dense_rows: Tensor, block_rows: Tensor | None
) -> Callable[[Tensor, Tensor | BlockWeight, Tensor | None], Tensor]:
    """A linear op for one step: rows ``dense_rows`` of a block weight with a dense copy go
    through :func:`dense_linear`, rows ``block_rows`` (None: no other rows) through the blocks.
    Weights without a dense copy (the head, tensors) take the usual op for every row."""

    def linear(x: Tensor, weight: Tensor | BlockWeight, bias: Tensor | None = None) -> Tensor:
        if not isinstance(weight, BlockWeight):
            return F.linear(x, weight, bias)
        if weight.dense is None:
            return block_linear(x, weight, bias)
        if block_rows is None:
            return dense_linear(x, weight.dense, bias)
        y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        y.index_copy_(0, block_rows, block_linear(x.index_select(0, block_rows), weight, bias))
        y.index_copy_(
            0, dense_rows, dense_linear(x.index_select(0, dense_rows), weight.dense, bias)
        )
        return y

    return linear
