"""The KV pool's tensors: per layer, K and V for every cell, grouped in pages.

```
k[layer]: [n_pages, page_size, n_kv_heads, head_dim]      (v[layer] the same)
           └── page p, offset o  ==  flat cell p * page_size + o
```
The Rust core decides which cells a sequence owns; this file only holds the numbers and writes a
step's rows to the cells ``runner/batch.py`` chose (``AttentionMetadata.slot_mapping``).

A model mixing sliding-window and global layers may keep its sliding layers' cells in a window
space of their own (``window_layers``; sched/window_space.py): their tensors then hold that
space's pages, and a page or cell number at or past the pool's count, in page copies and swap
parks' cell lists, is the window space's, less that count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpark.model.arch import ModelArch


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [n_pages, page_size, n_kv_heads, head_dim]
    v: list[torch.Tensor]
    # per layer: whether its cells are the window space's (empty: no window space)
    window_layers: list[bool] = field(default_factory=list)

    @classmethod
    def allocate(
        cls,
        arch: ModelArch,
        n_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        window_pages: int | None = None,
    ) -> KVCache:
        """``window_pages``: the sliding layers' pages in a window space of their own."""
        if n_pages <= 0 or page_size <= 0 or (window_pages is not None and window_pages <= 0):
            raise ValueError(
                f"n_pages ({n_pages}), page_size ({page_size}) and window_pages"
                f" ({window_pages}) must be positive"
            )
        layers = [
            window_pages is not None and arch.window_of(i) is not None for i in range(arch.n_layers)
        ]

        def zeros(windowed: bool) -> torch.Tensor:
            pages = window_pages if windowed and window_pages else n_pages
            shape = (pages, page_size, arch.n_kv_heads, arch.head_dim)
            # zeros, not empty: padded cells are masked out, but 0 * NaN garbage would still be NaN
            return torch.zeros(shape, dtype=dtype, device=device)

        k = [zeros(w) for w in layers]
        v = [zeros(w) for w in layers]
        return cls(k=k, v=v, window_layers=layers if any(layers) else [])

    @property
    def split(self) -> bool:
        """Whether the sliding layers keep their cells in a window space of their own."""
        return bool(self.window_layers)

    @property
    def n_pages(self) -> int:
        """The pool's pages (the global layers')."""
        windowed = self.window_layers or [False] * len(self.k)
        pool = [k for k, w in zip(self.k, windowed, strict=True) if not w]
        return (pool or self.k)[0].shape[0]

    def _spaces(self, ids: list[int], count: int) -> tuple[list[int], list[int]]:
        """Numbers split by space (numpy_pool.py's rule): the pool's, the window space's."""
        if not self.split:
            return ids, ids
        return [i for i in ids if i < count], [i - count for i in ids if i >= count]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy page src to page dst in every layer (copy-on-write of a shared page)."""
        if not pairs:
            return
        n = self.n_pages
        w = next((k.shape[0] for k, s in zip(self.k, self.window_layers, strict=False) if s), 0)
        for src, dst in pairs:
            same = (src < n) == (dst < n)
            if not (0 <= src < n + w and 0 <= dst < n + w and same) or src == dst:
                raise ValueError(f"bad page copy {src} -> {dst} (pool has {n} + {w} pages)")
        if len({dst for _, dst in pairs}) != len(pairs):
            raise ValueError(f"page copies {pairs} write one page twice")
        device = self.k[0].device
        srcs, dsts = self._spaces([s for s, _ in pairs], n), self._spaces([d for _, d in pairs], n)
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            space = int(self.split and self.window_layers[i])
            if not srcs[space]:
                continue
            src_idx = torch.tensor(srcs[space], dtype=torch.int64, device=device)
            dst_idx = torch.tensor(dsts[space], dtype=torch.int64, device=device)
            for cache in (k, v):
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
        """Copy the K and V of ``cells`` (every layer) into the host buffer ``out``; with a window
        space, layer after layer its K then its V of the listed cells of its space."""
        if self.split:
            self._copy_split(cells, out, save=True)
            return
        idx = torch.tensor(cells, dtype=torch.int64, device=self.k[0].device)
        self.cell_view(out, len(cells)).copy_(self.gather_cells(idx))

    def _copy_split(self, cells: list[int], buf: torch.Tensor, save: bool) -> None:
        """A window space's saved layout (numpy_pool.py's): saved into ``buf``, or restored."""
        _, _, heads, dim = self.k[0].shape
        spaces, at, device = self._spaces(cells, self.n_pages * self.page_size), 0, self.k[0].device
        for windowed, k, v in zip(self.window_layers, self.k, self.v, strict=True):
            ids = spaces[int(windowed)]
            idx = torch.tensor(ids, dtype=torch.int64, device=device)
            size = len(ids) * heads * dim
            for cache in (k, v):
                flat, part = cache.view(-1, heads, dim), buf[at : at + size]
                if save:
                    part.copy_(flat.index_select(0, idx).reshape(-1))
                else:
                    flat.index_copy_(0, idx, part.view(len(ids), heads, dim).to(device))
                at += size

    @torch.inference_mode()
    def restore_cells(self, src: torch.Tensor, cells: list[int], first: int = 0) -> None:
        """Write a saved state back into ``cells`` (any pages: a resume gets fresh ones); with
        ``first``, only its cells ``first..`` into ``cells[first:]`` (the ones before are cached
        pages the resume took by hash; a window space's saved state is restored whole)."""
        if self.split:
            if first:
                raise ValueError("a cache with a window space restores every cell it saved")
            self._copy_split(cells, src, save=False)
            return
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
