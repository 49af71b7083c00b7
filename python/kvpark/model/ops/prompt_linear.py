"""Prompt chunks through a dense GEMM instead of the block kernels.

A decode row reads every weight once, which the block kernels do in the fewest bytes; a prompt
chunk of hundreds of rows is compute-bound, where a dense GEMM (MKL float32, or oneDNN bfloat16 on
a CPU with native bf16) is faster (docs/cpu-kernels.md). A step that holds a prompt chunk sends
all its rows through the dense copies: split by rows, each projection would alternate the block
kernels' thread team with torch's, and on a small machine the two teams fight for the cores
(measured on 2 cores: 59 tok/s at 8 chats split by rows, 171 whole, 149 with no dense path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpark.model.ops.block_weights import BlockWeight, block_linear

Tensor = torch.Tensor


def dense_linear(x: Tensor, dense: Tensor, bias: Tensor | None) -> Tensor:
    """x [rows, in] float32 @ dense.T in dense's dtype, back to float32 (+ bias)."""
    y = F.linear(x.to(dense.dtype), dense).float()
    return y if bias is None else y.add_(bias)


def prompt_linear(x: Tensor, weight: Tensor | BlockWeight, bias: Tensor | None = None) -> Tensor:
    """The linear op of a step with a prompt chunk: a block weight's dense copy where it has one
    (every layer's matrices), the blocks where not (the head, which sees the sampled rows)."""
    if not isinstance(weight, BlockWeight):
        return F.linear(x, weight, bias)
    if weight.dense is None:
        return block_linear(x, weight, bias)
    return dense_linear(x, weight.dense, bias)
