"""RMSNorm, reduced in fp32 whatever the activations' dtype.

Row-wise, so a row's result never depends on the other rows of the batch: the exact op set can
use it unchanged. ``rms_norm_cpu`` is the default set's version on the CPU: one Rust call
(``rust/cpu_ops``) instead of torch's six ops, for contiguous float32 rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kvpark._core as _core


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] normalised over d, times weight [d]; same dtype as x."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel on the hot path
    # Hugging Face's order for half types: normalise in fp32, round to x's dtype, then scale.
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` in one Rust call for contiguous float32 CPU tensors; else ``rms_norm``."""
    d = x.shape[-1]
    if x.device.type == "cpu" and x.dtype == torch.float32:
        # the per-head q and k norms (Qwen3, Gemma 3) take views cut from the QKV rows: one
        # row's is contiguous, several rows' strided; both must reach the one kernel, or a
        # row's bits would depend on how many rows share its step (exact mode)
        x = x.contiguous()
    fits = x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
    if not (fits and weight.dtype == torch.float32 and weight.is_contiguous()) or d == 0:
        return rms_norm(x, weight, eps)
    if weight.shape != (d,) or weight.device.type != "cpu":
        raise ValueError(f"an rms_norm weight of shape {tuple(weight.shape)} for rows of {d}")
    out = torch.empty_like(x)
    _core._rms_norm(x.data_ptr(), x.numel(), weight.data_ptr(), d, eps, out.data_ptr())
    return out
