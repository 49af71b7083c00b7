"""RMSNorm over the last dimension, reduced in fp32: ``x * rsqrt(mean(x^2) + eps) * weight``.

```
x    [rows, d]   any row stride, d contiguous (leading dims of [..., d] are flattened)
w    [d]
out  [rows, d]   x's dtype
grid (rows,): one program normalises one whole row in one block of next_power_of_2(d)
```
One program per row with the whole row in one block means a row's sum of squares is always the
same reduction, whatever the number of rows: the result is batch invariant by construction.
For fp16/bf16 the order is Hugging Face's, as in ``kvpark.model.ops.norm``: normalise in fp32,
round to x's dtype, then multiply by the weight (the product of two half values is exact in fp32,
so the final rounding matches torch's half multiply).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, d], strides (stride_x, 1)
    w_ptr,  # [d]
    out_ptr,  # [rows, d] contiguous
    stride_x,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,  # True for half types: Hugging Face's rounding order
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols  # padding is 0: adds nothing
    y = x * tl.rsqrt(mean_square + eps)
    if ROUND_BEFORE_WEIGHT:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] normalised over d, times weight [d] -> [..., d] in x's dtype."""
    d = x.shape[-1]
    if weight.shape != (d,) or weight.device != x.device or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{d}] on {x.device}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {x.dtype}")
    rows = x.reshape(-1, d)  # a view when it can be; a copy for e.g. per-head slices of QKV
    if d and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            weight,
            out,
            rows.stride(0),
            d,
            eps,
            BLOCK=triton.next_power_of_2(d),
            ROUND_BEFORE_WEIGHT=x.dtype != torch.float32,
        )
    return out.view(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch definition, in the same rounding order as the kernel."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


if __name__ == "__main__":
    # On CPU: TRITON_INTERPRET=1 python kernels/rms_norm.py (set before triton.jit runs).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1")
    n_rows, d = (4096, 4096) if device == "cuda" else (64, 576)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(n_rows, d).to(device, dtype)
        w = torch.randn(d).to(device, dtype)
        err = (rms_norm(x, w, 1e-6).float() - rms_norm_reference(x, w, 1e-6).float()).abs()
        print(f"rms_norm {dtype}: max diff {err.max().item():.2e} vs reference")
        if device == "cuda":
            ms = triton.testing.do_bench(lambda: rms_norm(x, w, 1e-6))  # noqa: B023
            print(f"  {ms * 1e3:.1f} us for [{n_rows}, {d}]")
