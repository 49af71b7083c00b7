"""A step's cells in the Rust pool: reserving rows for sequences, what an admission or the decodes
need, and exporting the step's slot mapping and page tables in one crossing."""

from __future__ import annotations

from kvpark._core import KvPool, PoolFullError
from kvpark.sched.plan import StepItem, StepPlan
from kvpark.sched.request import Request, Sequence


def step_item(seq: Sequence, rows: int) -> StepItem:
    """The next ``rows`` rows of ``seq``; it samples when they reach its last known token."""
    start = seq.num_computed
    end = start + rows
    return StepItem(seq.seq_id, start, seq.tokens[start:end], sample=end == len(seq.tokens))


class StepCells:
    def __init__(self, pool: KvPool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size

    def reserve(self, seq: Sequence, rows: int) -> bool:
        """Cells for the next ``rows`` rows of ``seq``, all or none."""
        try:
            self.pool.reserve(seq.seq_id, seq.num_computed + rows)
        except PoolFullError:
            return False
        return True

    def fit_rows(self, seq: Sequence, rows: int) -> int:
        """Reserve cells for up to ``rows`` rows of ``seq``; returns how many rows got cells."""
        if self.reserve(seq, rows):
            return rows
        spare = self.pool.cells_free() + self._tail_room(seq)
        rows = min(rows, spare)
        if rows > 0 and self.reserve(seq, rows):
            return rows
        return 0

    def _tail_room(self, seq: Sequence) -> int:
        held = self.pool.seq_len(seq.seq_id)
        return (-held) % self.page_size

    def admission_fits(self, cells: int, running: list[Request]) -> bool:
        """Whether a new sequence taking ``cells`` free or cached cells fits now."""
        # keep a page of headroom for every decoding sequence, so admitting does not starve them
        decoding = sum(len(r.live_sequences) for r in running)
        return self.pool.can_fit(cells + decoding * self.page_size)

    def decode_shortfall(
        self, rows: dict[int, int], by_seq: dict[int, tuple[Request, Sequence]]
    ) -> int:
        """The cells this step's decodes (the sequences ``rows`` gives one row) lack, and the
        pages an ``n > 1`` prompt finishing this step needs when it forks."""
        pages = 0
        for seq_id, n in rows.items():
            req, seq = by_seq[seq_id]
            if n == 1 and seq.pending_rows == 1:
                pages += self.pool.pages_needed(seq_id, seq.num_computed + 1)
            elif n == seq.pending_rows and len(req.sequences) < req.params.n:
                pages += self._fork_pages(req, seq)
        return max(0, pages * self.page_size - self.pool.cells_free())

    def _fork_pages(self, req: Request, seq: Sequence) -> int:
        """Pages the last prompt chunk and the fork after it take."""
        copies = self.fork_copy_cells(req.params.n - len(req.sequences) + 1, len(seq.tokens))
        return self.pool.pages_needed(seq.seq_id, len(seq.tokens)) + copies // self.page_size

    def fork_copy_cells(self, n: int, prompt_len: int) -> int:
        """Cells the fork of a ``prompt_len`` prompt into ``n`` choices copies: each child takes
        a private copy of a partly used last page (without them the fork would fail after the
        step ran)."""
        return (n - 1) * self.page_size if prompt_len % self.page_size else 0

    def export(self, items: list[StepItem], copies: list[tuple[int, int]]) -> StepPlan:
        """The step's plan: its rows' slot mapping and page tables, and the page copies (of forks)
        that run before them."""
        if not items:
            return StepPlan([], [], [], copies)
        slot_mapping, tables = self.pool.export_step(
            [i.seq_id for i in items], [i.start for i in items], [len(i.token_ids) for i in items]
        )
        return StepPlan(items, slot_mapping, tables, copies)
