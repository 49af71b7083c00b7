"""Store a step's K and V rows into the paged KV pool, each row to the cell its slot names.

```
k, v     [T, kv_heads, head_dim]              rows of this step (views of the fused QKV are fine)
slots    [T] int64                            flat cell of each row: page * page_size + offset
k_cache  [n_pages, page_size, kv_heads, D]  ==  [n_cells, kv_heads, D]   (v_cache the same)
```
The same contract as ``kvpark.model.ops.kv_cache.store_kv`` (an ``index_copy_`` along the cells),
as one launch for K and V together: one program per row copies that row's ``kv_heads * head_dim``
values of K and of V. It is a pure copy, so the cache holds bit for bit what the model computed,
whatever the dtype. The rows arrive as strided views (the model slices K and V out of one fused
projection), so the kernel takes their row and head strides instead of forcing a copy.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvpark.model.ops.kv_cache import store_kv as torch_store_kv


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, kv_heads, D], strides (stride_kt, stride_kh, 1)
    v_ptr,  # [T, kv_heads, D], strides (stride_vt, stride_vh, 1)
    k_cache_ptr,  # [n_cells, kv_heads, D] contiguous
    v_cache_ptr,  # [n_cells, kv_heads, D] contiguous
    slot_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    n_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride may pass 2**31 on long steps
    slot = tl.load(slot_ptr + row)  # int64, so the cell offset below cannot overflow either
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_kv_heads) & (dims < head_dim)
    cell = slot * n_kv_heads * head_dim + heads * head_dim + dims
    k = tl.load(k_ptr + row * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache_ptr + cell, k, mask=mask)
    v = tl.load(v_ptr + row * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + cell, v, mask=mask)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write k, v [T, kv_heads, D] to cells slot_mapping [T] of k_cache, v_cache [pages,
    page_size, kv_heads, D], in place. note: slots must be distinct and inside the pool; that is
    checked only for CPU tensors, where it costs no device sync."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must be [pages, page_size, kv_heads, D]: {k_cache.shape}")
    if v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous and of one dtype")
    n_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    n_rows = slot_mapping.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.shape != (n_rows, n_kv, head_dim) or t.dtype != k_cache.dtype:
            raise ValueError(
                f"{name} {tuple(t.shape)} {t.dtype} does not fit the cache "
                f"[{n_rows}, {n_kv}, {head_dim}] {k_cache.dtype}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be [T] int64, got {slot_mapping.dtype}")
    if len({t.device for t in (k_cache, v_cache, slot_mapping, k, v)}) != 1:
        raise ValueError("all tensors must be on one device")
    if n_rows == 0:
        return
    n_cells = k_cache.shape[0] * k_cache.shape[1]
    on_host = slot_mapping.device.type == "cpu"  # a bounds check there costs no device sync
    if on_host and (int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= n_cells):
        raise ValueError(f"slot outside the pool of {n_cells} cells")
    _store_kv_kernel[(n_rows,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        n_kv,
        head_dim,
        BLOCK_H=triton.next_power_of_2(n_kv),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """The torch definition: the CPU op set's ``index_copy_`` along the flat cells."""
    torch_store_kv(k_cache, v_cache, slot_mapping, k, v)


if __name__ == "__main__":
    # On CPU: TRITON_INTERPRET=1 python kernels/store_kv.py (it must be set before triton.jit runs).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1")
    pages, page_size, n_kv, head_dim, n_rows = 64, 16, 8, 128, 300
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        caches = [torch.randn(pages, page_size, n_kv, head_dim).to(device, dtype) for _ in "kv"]
        slots = torch.randperm(pages * page_size, device=device)[:n_rows]
        qkv = torch.randn(n_rows, 3 * n_kv, head_dim).to(device, dtype)  # K, V as strided views
        k, v = qkv[:, n_kv : 2 * n_kv], qkv[:, 2 * n_kv :]
        want = [c.clone() for c in caches]
        store_kv_reference(*want, slots, k, v)
        store_kv(*caches, slots, k, v)
        assert all(torch.equal(a, b) for a, b in zip(caches, want, strict=True)), dtype
        print(f"store_kv {dtype}: exact")
        if device == "cuda":
            ms = triton.testing.do_bench(lambda: store_kv(*caches, slots, k, v))  # noqa: B023
            print(f"  {ms * 1e3:.1f} us for {n_rows} rows")
