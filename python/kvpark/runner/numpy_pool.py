"""The KV pool's cells as numpy arrays, for the torch-free CPU runner (lean_runner.py).

The layout is ``KVCache``'s (model/ops/kv_cache.py): per layer, K and V
``[n_pages, page_size, kv_heads, head_dim]``, page p offset o being cell p * page_size + o; the
Rust decoder writes and reads them through their addresses. 16-bit cells are kept as their bits
(numpy has no bfloat16: ``uint16``), copied as they are by page copies and swap parks.

A model mixing sliding-window and global layers may keep its sliding layers' K/V in a window
space of their own (``window_pages``, sched/window_space.py): their arrays then hold that many
pages, and a cell (or page) number at or past the pool's count names one of the window space,
less that count: what page copies and swap parks list.

A saved state (swap parks) has KVCache's host layout: layer after layer, its K then its V
``[n, kv_heads, head_dim]`` for the listed cells of its space (all of them without a window
space, ``[2 * layers, n_cells, kv_heads, head_dim]``), in the order the caller lists them.

The arrays are ``np.zeros``: calloc'd, so a page of cells no sequence has written yet takes no
memory until the decoder first writes it (and a padded cell reads 0, never NaN garbage).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvpark.model.arch import ModelArch

# the pool's cell type, by the name the Rust decoder takes
STORAGE = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}


class NumpyKVPool:
    def __init__(
        self,
        arch: ModelArch,
        n_pages: int,
        page_size: int,
        dtype: str,
        window_pages: int | None = None,
    ) -> None:
        if n_pages <= 0 or page_size <= 0 or (window_pages is not None and window_pages <= 0):
            raise ValueError(
                f"n_pages ({n_pages}), page_size ({page_size}) and window_pages"
                f" ({window_pages}) must be positive"
            )
        if dtype not in STORAGE:
            raise ValueError(f"a numpy pool holds {', '.join(STORAGE)} cells, not {dtype}")
        self.dtype = dtype
        self.n_pages = n_pages
        self.page_size = page_size
        self.window_pages = window_pages
        # which layers keep their cells in the window space
        self.sliding = [
            window_pages is not None and arch.window_of(i) is not None for i in range(arch.n_layers)
        ]
        shapes = {
            False: (n_pages, page_size, arch.n_kv_heads, arch.head_dim),
            True: (window_pages or n_pages, page_size, arch.n_kv_heads, arch.head_dim),
        }
        self.k = [np.zeros(shapes[s], STORAGE[dtype]) for s in self.sliding]
        self.v = [np.zeros(shapes[s], STORAGE[dtype]) for s in self.sliding]

    @property
    def n_cells(self) -> int:
        return self.n_pages * self.page_size

    @property
    def cell_shape(self) -> tuple[int, int]:
        return self.k[0].shape[2], self.k[0].shape[3]

    def bytes_per_cell(self) -> int:
        """K and V of one token, all layers."""
        heads, dim = self.cell_shape
        return 2 * len(self.k) * heads * dim * self.k[0].itemsize

    def _spaces(self, ids: list[int], count: int) -> tuple[list[int], list[int]]:
        """Cell (or page) numbers split by space: the pool's, and the window space's (those
        at or past ``count``, less it). Without a window space every layer takes them all."""
        if self.window_pages is None:
            return ids, ids
        return [i for i in ids if i < count], [i - count for i in ids if i >= count]

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy page src to page dst in every layer of its space (copy-on-write of a shared
        page)."""
        n, w = self.n_pages, self.window_pages or 0
        for src, dst in pairs:
            same = (src < n) == (dst < n)
            if not (0 <= src < n + w and 0 <= dst < n + w and same) or src == dst:
                raise ValueError(f"bad page copy {src} -> {dst} (pool has {n} + {w} pages)")
        if len({dst for _, dst in pairs}) != len(pairs):
            raise ValueError(f"page copies {pairs} write one page twice")
        if not pairs:
            return
        pools = self._spaces([s for s, _ in pairs], n), self._spaces([d for _, d in pairs], n)
        for sliding, k, v in zip(self.sliding, self.k, self.v, strict=True):
            src_idx, dst_idx = pools[0][sliding], pools[1][sliding]
            if src_idx:
                for cache in (k, v):
                    cache[dst_idx] = cache[src_idx]  # the gather copies first: a chain reads old

    def host_buffer(self, n_bytes: int) -> npt.NDArray[np.generic]:
        """A flat host buffer of at least ``n_bytes`` in the cells' type."""
        item = self.k[0].itemsize
        return np.empty(-(-n_bytes // item), dtype=self.k[0].dtype)

    def save_cells(self, cells: list[int], out: npt.NDArray[np.generic]) -> None:
        """Copy the K and V of ``cells`` (every layer, each its space's) into ``out``."""
        heads, dim = self.cell_shape
        spaces, at = self._spaces(cells, self.n_cells), 0
        for sliding, k, v in zip(self.sliding, self.k, self.v, strict=True):
            idx = spaces[sliding]
            size = len(idx) * heads * dim
            for cache in (k, v):
                out[at : at + size] = cache.reshape(-1, heads, dim)[idx].reshape(-1)
                at += size

    def restore_cells(self, src: npt.NDArray[np.generic], cells: list[int], first: int = 0) -> None:
        """Write a saved state back into ``cells``; with ``first``, only its cells ``first..``
        into ``cells[first:]`` (the ones before are cached pages a resume took by hash; a pool
        with a window space takes none)."""
        if first and self.window_pages is not None:
            raise ValueError("a pool with a window space restores every cell it saved")
        heads, dim = self.cell_shape
        spaces, at = self._spaces(cells, self.n_cells), 0
        for sliding, k, v in zip(self.sliding, self.k, self.v, strict=True):
            idx = spaces[sliding]
            size = len(idx) * heads * dim
            for cache in (k, v):
                saved = src[at : at + size].reshape(len(idx), heads, dim)
                cache.reshape(-1, heads, dim)[idx[first:]] = saved[first:]
                at += size
