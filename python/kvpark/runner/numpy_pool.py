"""The KV pool's cells as numpy arrays, for the torch-free CPU runner (lean_runner.py).

The layout is ``KVCache``'s (model/ops/kv_cache.py): per layer, K and V
``[n_pages, page_size, kv_heads, head_dim]``, page p offset o being cell p * page_size + o; the
Rust decoder writes and reads them through their addresses. 16-bit cells are kept as their bits
(numpy has no bfloat16: ``uint16``), copied as they are by page copies and swap parks.

A saved state (swap parks) has KVCache's host layout too: ``[2 * layers, n_cells, kv_heads,
head_dim]``, layer l's K at row 2l and its V at 2l + 1, cells in the order the caller lists them.

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
    def __init__(self, arch: ModelArch, n_pages: int, page_size: int, dtype: str) -> None:
        if n_pages <= 0 or page_size <= 0:
            raise ValueError(f"n_pages ({n_pages}) and page_size ({page_size}) must be positive")
        if dtype not in STORAGE:
            raise ValueError(f"a numpy pool holds {', '.join(STORAGE)} cells, not {dtype}")
        self.dtype = dtype
        self.n_pages = n_pages
        self.page_size = page_size
        shape = (n_pages, page_size, arch.n_kv_heads, arch.head_dim)
        self.k = [np.zeros(shape, STORAGE[dtype]) for _ in range(arch.n_layers)]
        self.v = [np.zeros(shape, STORAGE[dtype]) for _ in range(arch.n_layers)]

    @property
    def cell_shape(self) -> tuple[int, int]:
        return self.k[0].shape[2], self.k[0].shape[3]

    def bytes_per_cell(self) -> int:
        """K and V of one token, all layers."""
        heads, dim = self.cell_shape
        return 2 * len(self.k) * heads * dim * self.k[0].itemsize

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy page src to page dst in every layer (copy-on-write of a shared page)."""
        for src, dst in pairs:
            if not (0 <= src < self.n_pages and 0 <= dst < self.n_pages) or src == dst:
                raise ValueError(f"bad page copy {src} -> {dst} (pool has {self.n_pages} pages)")
        if len({dst for _, dst in pairs}) != len(pairs):
            raise ValueError(f"page copies {pairs} write one page twice")
        if not pairs:
            return
        src_idx = [s for s, _ in pairs]
        dst_idx = [d for _, d in pairs]
        for cache in (*self.k, *self.v):
            cache[dst_idx] = cache[src_idx]  # the gather copies first: a chain reads old pages

    def host_buffer(self, n_bytes: int) -> npt.NDArray[np.generic]:
        """A flat host buffer of at least ``n_bytes`` in the cells' type."""
        item = self.k[0].itemsize
        return np.empty(-(-n_bytes // item), dtype=self.k[0].dtype)

    def _saved(self, buf: npt.NDArray[np.generic], n_cells: int) -> npt.NDArray[np.generic]:
        """The first ``n_cells`` cells' worth of a flat buffer, in the saved-cell layout."""
        heads, dim = self.cell_shape
        rows = 2 * len(self.k)
        return buf[: rows * n_cells * heads * dim].reshape(rows, n_cells, heads, dim)

    def save_cells(self, cells: list[int], out: npt.NDArray[np.generic]) -> None:
        """Copy the K and V of ``cells`` (every layer) into ``out``."""
        heads, dim = self.cell_shape
        saved = self._saved(out, len(cells))
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            saved[2 * layer] = k.reshape(-1, heads, dim)[cells]
            saved[2 * layer + 1] = v.reshape(-1, heads, dim)[cells]

    def restore_cells(self, src: npt.NDArray[np.generic], cells: list[int], first: int = 0) -> None:
        """Write a saved state back into ``cells``; with ``first``, only its cells ``first..``
        into ``cells[first:]`` (the ones before are cached pages a resume took by hash)."""
        heads, dim = self.cell_shape
        saved = self._saved(src, len(cells))[:, first:]
        idx = cells[first:]
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k.reshape(-1, heads, dim)[idx] = saved[2 * layer]
            v.reshape(-1, heads, dim)[idx] = saved[2 * layer + 1]
