"""Batch-invariant matrix products for exact mode: every row goes through a GEMM of one fixed shape.

BLAS picks its kernel, blocking and reduction order from the call's shape, so a row's result from
``F.linear`` changes with the number of rows beside it (measured: every M >= 2 differs
from M = 1 in fp32 on this kind of CPU). Here the rows are cut into tiles of exactly ``ROW_TILE``
rows, the last one zero-padded, and the tiles go through ONE ``torch.bmm`` whose every batch
element is a ``[ROW_TILE, in] x [in, out]`` product: the shape BLAS sees per tile never changes,
and ``bmm`` is invariant to its batch dimension (tests/model/test_exact_ops.py holds it). A
row's bits then depend only on the row.

The weight is broadcast to the batch with a stride-0 ``expand``, never copied. The bias is added
after the product, elementwise, so no GEMM ever folds it into its accumulator.

On more than one torch thread (exact mode's dense CPU path runs on up to two) ``bmm`` is not
enough: MKL splits a lone GEMM between the threads and a batch of them by batch element, and on
some CPUs the two give other bits (an Intel Xeon with AVX-512: a [8, 576] x [576, 960] tile alone
differs from the same tile beside another). There each tile is its own ``torch.mm`` of the one
shape, which every call splits the same way.

ROW_TILE is part of the numerics: changing it changes exact mode's bits (not their invariance).
"""

from __future__ import annotations

import torch

ROW_TILE = 8


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias [out]) -> [rows, out], each row independently."""
    rows, n_in = x.shape
    n_out = weight.shape[0]
    tiles = max(1, -(-rows // ROW_TILE))
    if rows == tiles * ROW_TILE:
        padded = x.contiguous()
    else:
        padded = x.new_zeros((tiles * ROW_TILE, n_in))
        padded[:rows] = x
    if torch.get_num_threads() > 1:
        out = padded.new_empty((tiles * ROW_TILE, n_out))
        for t in range(tiles):
            at = slice(t * ROW_TILE, (t + 1) * ROW_TILE)
            torch.mm(padded[at], weight.t(), out=out[at])
    else:
        batch = padded.view(tiles, ROW_TILE, n_in)
        out = torch.bmm(batch, weight.t().expand(tiles, n_in, n_out)).view(-1, n_out)
    out = out[:rows]
    if bias is not None:
        out = out + bias
    return out
