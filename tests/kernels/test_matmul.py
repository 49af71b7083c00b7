"""The ``matmul`` kernel against ``F.linear`` in float64, in each dtype, with and without bias, on
masked edges; the batch invariance exact mode needs (a row's bits whatever the batch around it);
its refusals; and, on a GPU only, the same at real sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpark.kernels import matmul
from support.kernels import DTYPES, assert_close, needs_cuda, randn
from support.tiny_model import INTERPRET


def test_matmul_reduces_by_sum_exactly_when_interpreted() -> None:
    assert matmul.DOT_BY_SUM is INTERPRET  # tl.dot on a GPU; see kernels/matmul.py


@pytest.mark.parametrize("by_sum", [False, True] if INTERPRET else [False])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_matches_reference(
    dtype: torch.dtype, with_bias: bool, by_sum: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(matmul, "DOT_BY_SUM", by_sum)  # the tl.dot path, too, where interpreted
    # 37 x 70 x 72: no dimension a multiple of its block (32, 64, 32), so every edge is masked
    wide = randn(37, 80, dtype=dtype)
    x = wide[:, :72]  # a row stride that is not K
    w = randn(70, 72, dtype=dtype, seed=1) / 72**0.5
    bias = randn(70, dtype=dtype, seed=2) if with_bias else None
    got = matmul.matmul(x, w, bias)
    assert got.shape == (37, 70) and got.dtype == dtype
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert_close(got, want, dtype)
    assert_close(matmul.matmul_reference(x, w, bias), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_row_is_bitwise_the_same_whatever_the_batch(dtype: torch.dtype) -> None:
    w = randn(40, 48, dtype=dtype, seed=1)
    bias = randn(40, dtype=dtype, seed=2)
    row = randn(1, 48, dtype=dtype, seed=3)
    alone = matmul.matmul(row, w, bias)
    for m in (2, 3, 17, 33):
        for at in sorted({0, 1, m // 2, m - 1}):  # 33 - 1 = 32: the first row of a second tile
            x = randn(m, 48, dtype=dtype, seed=m)
            x[at] = row[0]
            assert torch.equal(matmul.matmul(x, w, bias)[at], alone[0]), (m, at)


def test_matmul_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="not \\[M, K\\]"):
        matmul.matmul(randn(3, 8), randn(4, 9))
    with pytest.raises(ValueError, match="contiguous along K"):
        matmul.matmul(randn(8, 3).t(), randn(4, 8))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matmul_real_sizes_are_close_and_batch_invariant(dtype: torch.dtype) -> None:
    w = randn(3000, 2048, dtype=dtype, seed=1) / 2048**0.5  # N not a multiple of BLOCK_N
    bias = randn(3000, dtype=dtype, seed=2)
    row = randn(1, 2048, dtype=dtype, seed=3)
    alone = matmul.matmul(row, w, bias)
    for m in (2, 7, 64, 333, 1024):
        x = randn(m, 2048, dtype=dtype, seed=m)
        for at in sorted({0, 5 % m, m // 2, m - 1}):
            x[at] = row[0]
            got = matmul.matmul(x, w, bias)
            assert torch.equal(got[at], alone[0]), (m, at)
        atol = 1e-3 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, matmul.matmul_reference(x, w, bias), atol=atol, rtol=1e-2)
