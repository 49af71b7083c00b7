"""Helpers the kernel tests (tests/kernels/) share: random tensors on :data:`DEVICE`, the tolerances
against an fp32/fp64 reference, and the paged layout of a step (sequences' cells on shuffled pages,
and the step's cell_index, row_seq and row_pos).

Without an NVIDIA GPU, conftest.py sets TRITON_INTERPRET=1 and every kernel runs on CPU tensors in
Triton's interpreter, one numpy call per op per program: shapes stay tiny (tens of programs, a few
loop steps). The interpreter checks indexing, masking and the structure of each reduction, not a
GPU's bits; the tests marked ``gpu`` (``needs_cuda``) add real sizes where CUDA is present. Bits
are compared inside one process ("alone" against "in a batch"), never against stored values.
"""

from __future__ import annotations

import random
from itertools import accumulate

import pytest
import torch

from kvpark.kernels import paged_attention
from support.tiny_model import DEVICE

needs_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA (not the interpreter)")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) against an fp32/fp64 reference: bf16 gets 2 ulps, as the interpreter truncates
# fp32 -> bf16 instead of rounding, and a norm rounds twice.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2**-10), torch.bfloat16: (2e-2, 2**-6)}


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEVICE, dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol)


def scatter(lengths: list[int], page_size: int, seed: int) -> tuple[list[list[int]], int]:
    """Cells for sequences of these lengths on shuffled pages (a page or two left unused)."""
    n_pages = sum(-(-n // page_size) for n in lengths) + 2
    pages = list(range(n_pages))
    random.Random(seed).shuffle(pages)
    cells = []
    for n in lengths:
        table = [pages.pop() for _ in range(-(-n // page_size))]
        cells.append([table[p // page_size] * page_size + p % page_size for p in range(n)])
    return cells, n_pages


def step(cells: list[list[int]], rows: list[int]) -> tuple[torch.Tensor, ...]:
    """cell_index [B, longest] (0-padded), row_seq, row_pos for a step."""
    index = torch.zeros(len(cells), max(map(len, cells)), dtype=torch.int64)
    for b, c in enumerate(cells):
        index[b, : len(c)] = torch.tensor(c)
    starts = [0, *accumulate(rows)]
    row_seq, row_pos = paged_attention.step_rows(starts, [len(c) for c in cells], DEVICE)
    return index.to(DEVICE), row_seq, row_pos
