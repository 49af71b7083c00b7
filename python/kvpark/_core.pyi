"""kvpark's KV cell pool, page tables and occupancy queries (the Rust crate kvpark-core).

Hand-written to mirror rust/py.rs; `python -m mypy.stubtest kvpark._core` checks the two agree.
"""

from typing import final

__all__ = ["KvPool", "PoolFullError"]

class PoolFullError(Exception):
    """Not enough free pages in the pool; the call changed nothing.

    The message says how many pages were needed and how many are free.
    """

@final
class KvPool:
    """The KV cell pool: pages of `page_size` cells with ref counts, and each sequence's page table.

    Sequence ids are ints >= 0 chosen by the caller; page ids are 0..n_pages; the cell of page p
    at offset o has the flat index p * page_size + o. Free pages are handed out LIFO: a fresh
    pool gives 0, 1, 2, ...; a released page is the next one given. Every failing call changes
    nothing. Unknown sequence: KeyError; too few free pages: PoolFullError; other bad
    arguments: ValueError.
    """

    def __new__(cls, n_cells: int, page_size: int = 16) -> KvPool:
        """ValueError unless page_size > 0, n_cells > 0 and n_cells is a multiple of page_size."""

    @property
    def page_size(self) -> int:
        """Cells per page."""

    @property
    def n_pages(self) -> int:
        """Pages in the pool."""

    @property
    def n_cells(self) -> int:
        """Cells in the pool."""

    def add_sequence(self, seq_id: int) -> None:
        """Add a sequence holding no cell. ValueError if it exists."""

    def has_sequence(self, seq_id: int) -> bool:
        """Whether the sequence exists."""

    def sequences(self) -> list[int]:
        """Every sequence id, ascending."""

    def seq_len(self, seq_id: int) -> int:
        """Cells (tokens) the sequence holds."""

    def page_table(self, seq_id: int) -> list[int]:
        """The sequence's pages in logical order."""

    def pages_needed(self, seq_id: int, n_tokens: int) -> int:
        """Extra pages the sequence needs to hold n_tokens cells in all (0 if it does already)."""

    def reserve(self, seq_id: int, n_tokens: int) -> list[int]:
        """Grow the sequence to hold n_tokens cells in all; return the new page ids.

        All or nothing: PoolFullError changes nothing. ValueError if n_tokens < seq_len.
        """

    def truncate(self, seq_id: int, n_tokens: int) -> list[tuple[int, int]]:
        """Keep the first n_tokens cells; release the pages no longer needed.

        A partly used new tail page shared with another sequence is replaced by a private copy:
        returns [(src_page, dst_page)], the page copy the runner must do, else [].
        PoolFullError (nothing changed) if no page is left for the copy; ValueError if
        n_tokens > seq_len.
        """

    def fork(self, parent: int, child: int) -> list[tuple[int, int]]:
        """Add sequence child sharing parent's full pages (ref counts +1).

        A partly used last page is not shared: the child gets a fresh page and the call returns
        [(src_page, dst_page)], the page copy the runner must do, else []. KeyError if parent is
        unknown, ValueError if child exists, PoolFullError (nothing changed) if no page is free.
        """

    def free_sequence(self, seq_id: int) -> int:
        """Remove the sequence; return the cells that went back to the pool."""

    def slot_mapping(self, seq_id: int, start: int, count: int) -> list[int]:
        """Flat cell indices page * page_size + offset of logical positions start..start+count.

        ValueError if start + count > seq_len.
        """

    def export_step(
        self, seq_ids: list[int], starts: list[int], counts: list[int]
    ) -> tuple[list[int], list[list[int]]]:
        """One call per step: (concatenated slot mappings of every item, each item's page table).

        Errors as slot_mapping; ValueError if the three lists differ in length.
        """

    def cells_used(self) -> int:
        """Cells in pages held by at least one sequence.

        A shared cell counts once, a partly used page in full.
        """

    def cells_free(self) -> int:
        """Cells in free pages."""

    def cells_freed_by(self, seq_ids: list[int]) -> int:
        """Cells that removing exactly these sequences would free.

        A sequence given twice counts once; KeyError for an unknown one.
        """

    def can_fit(self, n_cells: int) -> bool:
        """Whether n_cells more cells, rounded up to whole pages, fit in the free pages."""

    def page_refcount(self, page: int) -> int:
        """How many page tables hold the page (0: free). ValueError if not in 0..n_pages."""

    def check_integrity(self) -> None:
        """Check every invariant of the pool in O(pool); RuntimeError naming the broken one."""

    def reset(self) -> None:
        """Drop every sequence; the pool is then as if new."""
