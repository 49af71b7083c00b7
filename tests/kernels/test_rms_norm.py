"""The ``rms_norm`` kernel against ``F.rms_norm`` and its torch reference, in each dtype, with rows
that are independent (a row alone, or a strided view, gives the same bits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpark.kernels import rms_norm
from support.kernels import DTYPES, assert_close, randn


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    x = randn(5, 3, 40, dtype=dtype)  # leading dims flattened; d = 40 masks a block of 64
    w = randn(40, dtype=dtype, seed=1)
    got = rms_norm.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:
        want = F.rms_norm(x, (40,), w, 1e-6)
    else:  # kvpark.model.ops.norm's order: normalise in fp32, round, then scale
        want = (F.rms_norm(x.float(), (40,), None, 1e-6).to(dtype) * w).float()
    assert_close(got, want, dtype)
    assert_close(rms_norm.rms_norm_reference(x, w, 1e-6), want, dtype)
    # Rows are independent: one row alone gives the same bits, and so does a strided view.
    assert torch.equal(rms_norm.rms_norm(x[2:3, 1], w, 1e-6), got[2:3, 1])
    fused = randn(4, 6, 40, dtype=dtype, seed=2)  # per-head slices of a QKV projection (Qwen3)
    heads = fused[:, 1:4]
    assert torch.equal(rms_norm.rms_norm(heads, w, 1e-6), rms_norm.rms_norm(heads.clone(), w, 1e-6))
