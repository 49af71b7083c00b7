"""RMSNorm, reduced in fp32 whatever the activations' dtype.

Row-wise, so a row's result never depends on the other rows of the batch (feasibility §3.1): the
exact op set can use it unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] normalised over d, times weight [d]; same dtype as x."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel on the hot path
    # Hugging Face's order for half types: normalise in fp32, round to x's dtype, then scale.
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight
