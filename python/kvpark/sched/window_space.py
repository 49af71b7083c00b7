"""The window space: where a model that mixes sliding-window and global layers (Gemma 2 and 3)
keeps its sliding layers' K/V, apart from the global layers' cells in the pool.

A global layer reads a sequence's whole context, so the pool keeps every page of it; a sliding
layer reads only the last ``window`` positions, so its cells can go once the sequence has moved
past them. Sharing one cell between both kinds of layer would keep the sliding layers' K/V as long
as the global layers', the window's saving lost. Here every sequence holds cells in two Rust
pools of one page size: the pool (global layers, what the scheduler and the preemption planner
count) and this space, a ``KvPool`` with the window set (sliding layers; its pages behind the
window go back after every step, as an every-layer-sliding pool's do, cells.py).

The space is sized so that it never runs short (:func:`window_space_cells`): each of the
``--parallel`` sequences holds at most its last ``window - 1`` positions and its step's rows, on
pages that need not start aligned, and a step's rows are at most ``--max-batch-tokens``; cached
pages there are evicted before it refuses a page. So only the pool's cells decide what fits, and
the memory of the sliding layers' K/V stops growing with the context: a Gemma 3 model (five
sliding layers to a global one) keeps about a sixth of the K/V of long conversations.

Cell and page numbers of this space appear in combined lists (a swap park's cells, the plan's
page copies) offset by the pool's cell and page counts: a number at or past them is this space's
(``runner/numpy_pool.py`` reads them so). A prefix hit must be found in both: the pool's pages
before the hit, and this space's pages of the window before it (``rust/pool/window_hit.rs``).
"""

from __future__ import annotations

from kvpark._core import KvPool, PoolFullError


def window_space_cells(
    window: int, page_size: int, parallel: int, max_batch_tokens: int, kv_cells: int
) -> int | None:
    """Cells the window space needs never to run short, or None where that is no fewer than
    the pool's ``kv_cells`` (the sliding layers then share the pool's cells: nothing to save).

    A sequence computing ``r`` rows holds positions ``len - window + 1 .. len + r``: at most
    ``ceil((window - 1 + r) / page_size) + 1`` pages, fewer than ``(window - 1 + r) /
    page_size + 2``; summed over ``parallel`` sequences whose rows add up to at most
    ``max_batch_tokens``, fewer than ``parallel * (window - 1 + 2 * page_size) +
    max_batch_tokens`` cells."""
    cells = parallel * (window - 1 + 2 * page_size) + max_batch_tokens
    cells = -(-cells // page_size) * page_size
    return cells if cells < kv_cells else None


class WindowSpace:
    """The sliding layers' cells: every sequence of the scheduler's pool is one here too."""

    def __init__(
        self, n_cells: int, page_size: int, window: int, pool_cells: int, salt: int | None
    ) -> None:
        self.pool = KvPool(n_cells, page_size, prefix_cache_salt=salt, window=window)
        self.window = window
        self.page_size = page_size
        self.cell_offset = pool_cells  # this space's cell c is c + pool_cells in combined lists
        self.page_offset = pool_cells // page_size

    def add(self, seq_id: int, salt: int) -> None:
        self.pool.add_sequence(seq_id, salt)

    def drop(self, seq_id: int) -> None:
        if self.pool.has_sequence(seq_id):
            self.pool.free_sequence(seq_id)

    def slide(self, seq_id: int) -> None:
        """Give back the pages behind the window of the sequence's next row."""
        if self.pool.has_sequence(seq_id):
            start = self.pool.seq_len(seq_id) - self.window + 1
            self.pool.release_before(seq_id, max(0, start))

    def reserve(self, seq_id: int, n_cells: int) -> bool:
        try:
            self.pool.reserve(seq_id, n_cells)
        except PoolFullError:
            return False
        return True

    def joint_hit(self, tokens: list[int], hit: int, salt: int) -> int:
        """The longest prefix hit of at most ``hit`` tokens (the pool's) whose window pages are
        cached here too. The pool's hits are prefixes (any shorter one holds too), and this
        space answers the longest of its own at most ``hit``: that one holds in both."""
        return self.pool.cached_prefix(tokens, hit, salt)[0] if hit else 0

    def match(self, seq_id: int, tokens: list[int], hit: int) -> None:
        """Take the window pages of a joint hit of ``hit`` tokens (:meth:`joint_hit`)."""
        got = self.pool.match_prefix(seq_id, tokens, hit)
        assert got == hit, f"window space hit {got} of the pool's {hit}"

    def fork(self, parent: int, child: int) -> list[tuple[int, int]]:
        """The child's share of the parent's pages; its page copies, offset (combined)."""
        off = self.page_offset
        return [(s + off, d + off) for s, d in self.pool.fork(parent, child)]

    def register_step(self, seq_ids: list[int], tokens: list[list[int]]) -> None:
        if self.pool.prefix_cache_salt is not None:
            self.pool.register_step(seq_ids, tokens)

    def register_tokens(self, seq_id: int, tokens: list[int]) -> None:
        if self.pool.prefix_cache_salt is not None:
            self.pool.register_tokens(seq_id, tokens)

    def released(self, seq_id: int) -> int:
        return self.pool.released_cells(seq_id) if self.pool.has_sequence(seq_id) else 0

    def cells(self, seq_id: int, end: int) -> list[int]:
        """The sequence's cells here from the first it holds to ``end``, offset (combined)."""
        first = self.pool.released_cells(seq_id)
        off = self.cell_offset
        return [c + off for c in self.pool.slot_mapping(seq_id, first, end - first)]

    def restore(self, seq_id: int, salt: int, first: int, n_cells: int) -> list[int]:
        """Fresh cells for a swap's saved positions ``first .. n_cells`` (PoolFullError: none
        taken); their combined numbers."""
        self.pool.add_sequence(seq_id, salt)
        if first:
            self.pool.release_before(seq_id, first)
        try:
            self.pool.reserve(seq_id, n_cells)
        except PoolFullError:
            self.pool.free_sequence(seq_id)
            raise
        return self.cells(seq_id, n_cells)
