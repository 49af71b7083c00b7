"""Batch-invariant matrix products for exact mode: every row goes through a GEMM of one fixed shape.

BLAS picks its kernel, blocking and reduction order from the call's shape, so a row's result from
``F.linear`` changes with the number of rows beside it (measured: every M >= 2 differs
from M = 1 in fp32 on this kind of CPU). Here the rows are cut into tiles of exactly one row
count, the last one zero-padded, and the tiles go through ONE ``torch.bmm`` whose every batch
element is a ``[tile, in] x [in, out]`` product: the shape BLAS sees per tile never changes,
and ``bmm`` is invariant to its batch dimension (tests/model/test_exact_ops.py holds it).

A fixed shape is not enough on its own: the BLAS must also give every row of the tile the same
arithmetic. MKL's AVX2 kernels (an AVX2-only Intel CPU, or ``KVPARK_CPU_ISA=avx2``) work in
strips of six rows, so an 8-row tile's last two rows come from another kernel with other bits,
and a row's bits would follow its place in the tile. So the tile is the first of
``TILE_CHOICES`` for which every row of a tile comes out as it does at the head of a tile of other
rows, checked once per (device, dtype, shape, threads) by ``row_tile``'s probe on random values:
8 where the BLAS allows (its kernels on AVX-512, and CUDA), 12 under MKL's AVX2 strips; one row
per product (every call the same ``[1, in]`` shape) if none does.

The weight is broadcast to the batch with a stride-0 ``expand``, never copied. The bias is added
after the product, elementwise, so no GEMM ever folds it into its accumulator.

On more than one torch thread (exact mode's dense CPU path runs on up to two) ``bmm`` is not
enough: MKL splits a lone GEMM between the threads and a batch of them by batch element, and on
some CPUs the two give other bits (an Intel Xeon with AVX-512: a [8, 576] x [576, 960] tile alone
differs from the same tile beside another). There each tile is its own ``torch.mm`` of the one
shape, which every call splits the same way.

The tile is part of the numerics: another tile gives other exact-mode bits (not other invariance).
"""

from __future__ import annotations

import functools

import torch

# Row counts a tile may take, in order of preference: 8 first (the tile every machine used before
# the probe existed, so their bits stay), then multiples of the six-row strips of MKL's AVX2
# kernels, then smaller ones.
TILE_CHOICES = (8, 12, 16, 24, 6, 4, 2)


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias [out]) -> [rows, out], each row independently."""
    rows, n_in = x.shape
    n_out = weight.shape[0]
    tile = row_tile(weight.device, weight.dtype, n_in, n_out, torch.get_num_threads())
    out = _product(x, weight, tile)[:rows]
    if bias is not None:
        out = out + bias
    return out


def _product(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
    """``x @ weight.T`` in tiles of ``tile`` rows, the last zero-padded: ``[tiles * tile, out]``."""
    rows, n_in = x.shape
    n_out = weight.shape[0]
    tiles = max(1, -(-rows // tile))
    if rows == tiles * tile:
        padded = x.contiguous()
    else:
        padded = x.new_zeros((tiles * tile, n_in))
        padded[:rows] = x
    if torch.get_num_threads() > 1:
        out = padded.new_empty((tiles * tile, n_out))
        for t in range(tiles):
            at = slice(t * tile, (t + 1) * tile)
            torch.mm(padded[at], weight.t(), out=out[at])
        return out
    batch = padded.view(tiles, tile, n_in)
    return torch.bmm(batch, weight.t().expand(tiles, n_in, n_out)).view(-1, n_out)


@functools.cache
def row_tile(device: torch.device, dtype: torch.dtype, n_in: int, n_out: int, threads: int) -> int:
    """The first of ``TILE_CHOICES`` whose every row's bits do not depend on its place in the
    tile or on its neighbours for this product's shape (1 if none): see the module's docstring.

    ``threads`` is a key only (the products read ``torch.get_num_threads()``, which the caller
    passes): one thread takes one ``bmm``, more a ``torch.mm`` per tile, and each its own kernels.
    """
    del threads
    g = torch.Generator().manual_seed(n_in * 7919 + n_out)
    weight = (torch.randn(n_out, n_in, generator=g) / n_in**0.5).to(device, dtype)
    for tile in TILE_CHOICES:
        rows = torch.randn(tile, n_in, generator=g).to(device, dtype)
        together = _product(rows, weight, tile)
        if all(_heads_a_tile(rows[r], weight, tile, g).equal(together[r]) for r in range(tile)):
            return tile
    return 1


def _heads_a_tile(
    row: torch.Tensor, weight: torch.Tensor, tile: int, g: torch.Generator
) -> torch.Tensor:
    """``row``'s product at the head of a tile whose other rows are fresh random values."""
    rows = torch.randn(tile, row.shape[0], generator=g).to(row.device, row.dtype)
    rows[0] = row
    return _product(rows, weight, tile)[0]
