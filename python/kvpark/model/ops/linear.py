"""Matrix products of activations with weights: the op an exact (batch-invariant) set replaces.

``llama.py`` never calls ``F.linear`` itself; every projection goes through ``OpSet.linear`` so
that a mode can swap in fixed row tiles or a batch-invariant kernel without touching the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias [out]) -> [rows, out], one BLAS call."""
    return F.linear(x, weight, bias)
