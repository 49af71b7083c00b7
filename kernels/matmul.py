"""Batch-invariant matmul: ``x [M, K] @ w[N, K].T (+ bias [N]) -> [M, N]``, weights as the model
stores them ([out, in], Hugging Face's layout).

```
x    [M, K]   strides (stride_xm, 1)
w    [N, K]   strides (stride_wn, 1)
out  [M, N]   contiguous, x's dtype
grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): one program = one BLOCK_M x BLOCK_N tile of out
    acc = 0 (fp32)
    for k0 in 0, BLOCK_K, 2 BLOCK_K, ... < K:      always this order, always this BLOCK_K
        acc += x[tile rows, k0:k0+BLOCK_K] @ w[tile cols, k0:k0+BLOCK_K].T
    out[tile] = acc (+ bias, after the loop)
```
Why the bits of row m never depend on M or on where the row sits: the tile sizes are constants
(not autotuned, not picked from M), there is no split-K (each output element is reduced by one
program, in one K order), and each row of a ``tl.dot`` tile is reduced independently of the
others. A library GEMM picks its kernel and split from the shapes, so a decode row and the same
row inside a prompt can differ in the last bits; this kernel cannot.

Loads are upcast to fp32 before ``tl.dot``: the interpreter multiplies bf16 bit patterns otherwise.
On a GPU, half inputs are exact in tf32, so "tf32" loses nothing for them; fp32
inputs use "ieee" so exact mode in fp32 is not silently TF32.

Under the interpreter ``tl.dot`` is numpy's matmul, i.e. OpenBLAS, whose sgemm reduces some rows of
a tile differently from others (measured: rows 6-11 and 18-31 of a 32-row tile, with or without
FMA), so a row's bits would depend on its place in the tile. There the kernel forms the same tile
product as a broadcast multiply summed over K (``DOT_BY_SUM``), which numpy reduces in k order for
every element alike; the tiles, the K loop and the masking stay the ones the GPU runs.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Fixed for every call: changing any of them changes the bits (and batch invariance needs them
# constant across calls, never chosen from M).
BLOCK_M = 32
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4


@triton.jit
def _matmul_kernel(
    x_ptr,  # [M, K], strides (stride_xm, 1)
    w_ptr,  # [N, K], strides (stride_wn, 1)
    bias_ptr,  # [N]; unused (any pointer) when HAS_BIAS is False
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_BY_SUM: tl.constexpr,  # True only under the interpreter (see the module docstring)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    # int64 offsets: a large vocabulary's lm_head alone can hold more than 2**31 elements.
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn  # [1, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K  # padding is 0 in both operands: it adds exact zeros
        x_mask = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_rows + (k0 + ks)[None, :], mask=x_mask, other=0.0).to(tl.float32)  # [BM, BK]
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_cols + (k0 + ks)[:, None], mask=w_mask, other=0.0).to(tl.float32)  # [BK, BN]
        if DOT_BY_SUM:
            acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok)


DOT_BY_SUM = isinstance(_matmul_kernel, InterpretedFunction)


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias [N]) -> [M, N] in x's dtype, accumulated in fp32; row m's
    bits do not depend on M or on the other rows."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} are not [M, K] and [N, K]")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("x and w must be contiguous along K")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or w.dtype != x.dtype:
        raise ValueError(f"unsupported dtypes x {x.dtype}, w {w.dtype}")
    (n_rows, k), n_cols = x.shape, w.shape[0]
    if bias is not None and (bias.shape != (n_cols,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n_cols}]")
    if len({t.device for t in (x, w, bias) if t is not None}) != 1:
        raise ValueError("all tensors must be on one device")
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(n_rows, BLOCK_M), triton.cdiv(n_cols, BLOCK_N))
    _matmul_kernel[grid](
        x,
        w,
        w if bias is None else bias,
        out,
        n_rows,
        n_cols,
        k,
        x.stride(0),
        w.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_BY_SUM=DOT_BY_SUM,
        num_warps=NUM_WARPS,
    )
    return out


def matmul_reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch definition in fp32, rounded to x's dtype at the end like the kernel."""
    out = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


if __name__ == "__main__":
    # On CPU: TRITON_INTERPRET=1 python kernels/matmul.py (set before triton.jit runs).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1")
    m, n, k = (4096, 4096, 4096) if device == "cuda" else (70, 100, 96)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(m, k).to(device, dtype)
        w = torch.randn(n, k).to(device, dtype) / k**0.5
        b = torch.randn(n).to(device, dtype)
        err = (matmul(x, w, b).float() - matmul_reference(x, w, b).float()).abs().max().item()
        alone = torch.equal(matmul(x[5:6], w, b)[0], matmul(x, w, b)[5])
        print(f"matmul {dtype}: max diff {err:.2e} vs reference; row alone == in batch: {alone}")
        if device == "cuda":
            ms = triton.testing.do_bench(lambda: matmul(x, w, b))  # noqa: B023
            print(f"  {2 * m * n * k / ms * 1e-9:.1f} TFLOP/s at {m}x{n}x{k}")
