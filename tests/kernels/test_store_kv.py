"""The ``store_kv`` kernel: it writes a step's K and V rows into exactly their pool slots, the same
as its torch reference, and refuses what it cannot store (support/kernels.py: the interpreter
without a GPU)."""

from __future__ import annotations

import pytest
import torch

from kvpark.kernels import store_kv
from support.kernels import DTYPES, randn
from support.tiny_model import DEVICE


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_exactly_the_slots(dtype: torch.dtype) -> None:
    n_pages, page_size, n_kv, head_dim, n_rows = 6, 4, 3, 12, 9  # 3 x 12: both dims masked
    caches = [randn(n_pages, page_size, n_kv, head_dim, dtype=dtype, seed=s) for s in (1, 2)]
    slots = torch.randperm(n_pages * page_size, generator=torch.Generator().manual_seed(0))
    slots = slots[:n_rows].to(DEVICE)
    qkv = randn(n_rows, 3 * n_kv, head_dim, dtype=dtype, seed=3)  # K, V as the model's views
    k, v = qkv[:, n_kv : 2 * n_kv], qkv[:, 2 * n_kv :]
    want = [c.clone() for c in caches]
    store_kv.store_kv_reference(*want, slots, k, v)
    store_kv.store_kv(*caches, slots, k, v)
    for got, expected in zip(caches, want, strict=True):
        assert torch.equal(got, expected)
    flat_k = caches[0].view(-1, n_kv, head_dim)
    assert torch.equal(flat_k[slots], k) and not torch.equal(flat_k[slots], v)


def test_store_kv_rejects_what_it_cannot_store() -> None:
    k_cache, v_cache = randn(2, 4, 2, 8), randn(2, 4, 2, 8)
    k = v = randn(3, 2, 8)
    with pytest.raises(ValueError, match="does not fit"):
        store_kv.store_kv(k_cache, v_cache, torch.arange(3, device=DEVICE), k.half(), v)
    with pytest.raises(ValueError, match="int64"):
        store_kv.store_kv(k_cache, v_cache, torch.arange(3, device=DEVICE).int(), k, v)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="outside the pool"):
            store_kv.store_kv(k_cache, v_cache, torch.tensor([0, 1, 8]), k, v)
