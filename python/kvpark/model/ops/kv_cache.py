"""The KV pool's tensors: per layer, K and V for every cell, grouped in pages.

```
k[layer]: [n_pages, page_size, n_kv_heads, head_dim]      (v[layer] the same)
           └── page p, offset o  ==  flat cell p * page_size + o
```
The Rust core decides which cells a sequence owns; this file only holds the numbers and writes a
step's rows to the cells ``runner/batch.py`` chose (``AttentionMetadata.slot_mapping``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpark.model.arch import ModelArch


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [n_pages, page_size, n_kv_heads, head_dim]
    v: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        arch: ModelArch,
        n_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        if n_pages <= 0 or page_size <= 0:
            raise ValueError(f"n_pages ({n_pages}) and page_size ({page_size}) must be positive")
        shape = (n_pages, page_size, arch.n_kv_heads, arch.head_dim)
        # zeros, not empty: padded cells are masked out, but 0 * NaN garbage would still be NaN.
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.n_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.n_layers)]
        return cls(k=k, v=v)

    @property
    def n_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy page src to page dst in every layer (copy-on-write of a shared page)."""
        if not pairs:
            return
        for src, dst in pairs:
            if not (0 <= src < self.n_pages and 0 <= dst < self.n_pages) or src == dst:
                raise ValueError(f"bad page copy {src} -> {dst} (pool has {self.n_pages} pages)")
        if len({dst for _, dst in pairs}) != len(pairs):
            raise ValueError(f"page copies {pairs} write one page twice")
        device = self.k[0].device
        src_idx = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
        dst_idx = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
        for cache in (*self.k, *self.v):
            cache.index_copy_(0, dst_idx, cache.index_select(0, src_idx))

    def bytes_per_cell(self) -> int:
        """K and V of one token, all layers. Plain arithmetic on the shape, no tensor op: the
        preemption planner asks for it once per request every step."""
        _, _, heads, dim = self.k[0].shape
        return 2 * len(self.k) * heads * dim * self.k[0].element_size()

    # ---- the host-buffer layout of saved cells (swap parks), owned here and nowhere else:
    # [2 * layers, n_cells, kv_heads, head_dim], K of layer l at row 2l and V at 2l + 1, cells in
    # the order the caller lists them; a buffer is a flat tensor in the KV dtype

    def cell_view(self, buf: torch.Tensor, n_cells: int) -> torch.Tensor:
        """The first ``n_cells`` cells' worth of a flat host buffer, in the saved-cell layout."""
        _, _, heads, dim = self.k[0].shape
        rows = 2 * len(self.k)
        return buf[: rows * n_cells * heads * dim].view(rows, n_cells, heads, dim)

    def gather_cells(self, idx: torch.Tensor) -> torch.Tensor:
        """K and V of the cells ``idx`` [n] (on the KV device) in every layer, in that layout."""
        _, _, heads, dim = self.k[0].shape
        out = torch.empty(
            (2 * len(self.k), idx.numel(), heads, dim), dtype=self.k[0].dtype, device=idx.device
        )
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            torch.index_select(k.view(-1, heads, dim), 0, idx, out=out[2 * layer])
            torch.index_select(v.view(-1, heads, dim), 0, idx, out=out[2 * layer + 1])
        return out

    def scatter_cells(self, idx: torch.Tensor, states: torch.Tensor) -> None:
        """Write ``states`` (that layout, on the KV device) into the cells ``idx``."""
        _, _, heads, dim = self.k[0].shape
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k.view(-1, heads, dim).index_copy_(0, idx, states[2 * layer])
            v.view(-1, heads, dim).index_copy_(0, idx, states[2 * layer + 1])

    @torch.inference_mode()
    def save_cells(self, cells: list[int], out: torch.Tensor) -> None:
        """Copy the K and V of ``cells`` (every layer) into the host buffer ``out``."""
        idx = torch.tensor(cells, dtype=torch.int64, device=self.k[0].device)
        self.cell_view(out, len(cells)).copy_(self.gather_cells(idx))

    @torch.inference_mode()
    def restore_cells(self, src: torch.Tensor, cells: list[int], first: int = 0) -> None:
        """Write a saved state back into ``cells`` (any pages: a resume gets fresh ones); with
        ``first``, only its cells ``first..`` into ``cells[first:]`` (the ones before are cached
        pages the resume took by hash)."""
        device = self.k[0].device
        idx = torch.tensor(cells[first:], dtype=torch.int64, device=device)
        self.scatter_cells(idx, self.cell_view(src, len(cells))[:, first:].to(device))


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write each row's k, v [T, n_kv_heads, head_dim] to its cell slot_mapping [T] of one layer,
    rounded to the pool's dtype as ``.to()`` rounds (a 16-bit pool under float32 activations,
    ``--kv-dtype``)."""
    n_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(-1, n_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, n_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
