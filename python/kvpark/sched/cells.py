"""A step's cells in the Rust pool: reserving rows for sequences, what an admission or the decodes
need, giving back the pages behind a sliding window, and exporting the step's slot mapping and page
tables in one crossing.

With a ``window`` (every layer of the model attends over its last ``window`` positions only), a
sequence's pages wholly behind the window of its next row are released as soon as a step has
written the row after them: a sequence then holds at most its window plus the rows of one step,
however long it grows (``window_cells``), and what the scheduler and the planner count is what it
holds. Its released positions stay its own (its length, tokens and registered prefix are
unchanged); their pages go back to the pool, cached if registered.

A model mixing sliding and global layers keeps its sliding layers' cells in a window space
(``space``, window_space.py): every sequence operation here is carried out in both."""

from __future__ import annotations

from kvpark._core import KvPool, PoolFullError
from kvpark.sched.plan import StepItem, StepPlan
from kvpark.sched.request import Request, Sequence
from kvpark.sched.window_space import WindowSpace


def _choices_left(req: Request) -> int:
    """The choices of an ``n > 1`` request that may still grow: all ``n`` until its prompt
    forks, then those not finished (a finished choice's own pages went back)."""
    forked = len(req.sequences) == req.params.n
    return len(req.live_sequences) if forked else req.params.n


def step_item(seq: Sequence, rows: int) -> StepItem:
    """The next ``rows`` rows of ``seq``; it samples when they reach its last known token."""
    start = seq.num_computed
    end = start + rows
    return StepItem(seq.seq_id, start, seq.tokens[start:end], sample=end == len(seq.tokens))


class StepCells:
    def __init__(
        self,
        pool: KvPool,
        page_size: int,
        window: int | None = None,
        space: WindowSpace | None = None,
    ) -> None:
        self.pool = pool
        self.page_size = page_size
        self.window = window
        self.space = space

    def add_sequence(self, seq_id: int, salt: int) -> None:
        self.pool.add_sequence(seq_id, salt)
        if self.space is not None:
            self.space.add(seq_id, salt)

    def free_sequence(self, seq_id: int) -> None:
        if self.pool.has_sequence(seq_id):
            self.pool.free_sequence(seq_id)
        if self.space is not None:
            self.space.drop(seq_id)

    def prefix_hit(self, tokens: list[int], reusable: int, salt: int) -> int:
        """The longest cached prefix of at most ``reusable`` tokens a new sequence can start
        after (in the window space too, where there is one)."""
        hit, _ = self.pool.cached_prefix(tokens, reusable, salt)
        return hit if self.space is None else self.space.joint_hit(tokens, hit, salt)

    def match_prefix(self, seq_id: int, tokens: list[int], reusable: int, salt: int) -> int:
        """Take the cached prefix :meth:`prefix_hit` finds; returns its length."""
        if self.space is None:
            return self.pool.match_prefix(seq_id, tokens, reusable)
        hit = self.prefix_hit(tokens, reusable, salt)
        self.space.match(seq_id, tokens, hit)
        return self.pool.match_prefix(seq_id, tokens, hit)

    def fork(self, parent: int, child: int) -> list[tuple[int, int]]:
        """The child shares the parent's pages; the page copies its partly used last ones need
        (the window space's offset, plan.py)."""
        copies = self.pool.fork(parent, child)
        return copies if self.space is None else copies + self.space.fork(parent, child)

    def register_step(self, seq_ids: list[int], tokens: list[list[int]]) -> None:
        self.pool.register_step(seq_ids, tokens)
        if self.space is not None:
            self.space.register_step(seq_ids, tokens)

    def register_tokens(self, seq_id: int, tokens: list[int]) -> None:
        self.pool.register_tokens(seq_id, tokens)
        if self.space is not None:
            self.space.register_tokens(seq_id, tokens)

    def park_cells(self, seq_id: int, first: int, end: int) -> list[int]:
        """What a swap park saves: the cells of positions ``first .. end`` in the pool, then
        the window space's it holds (offset)."""
        cells = self.pool.slot_mapping(seq_id, first, end - first)
        return cells if self.space is None else cells + self.space.cells(seq_id, end)

    def slide(self, seq_id: int) -> None:
        """Give back the pages of ``seq_id`` wholly behind its next row's window: that row, at
        position ``seq_len``, reads positions ``seq_len - window + 1 ..`` and no later row reads
        further back."""
        if self.window is not None:
            self.pool.release_before(seq_id, max(0, self.pool.seq_len(seq_id) - self.window + 1))
        if self.space is not None:
            self.space.slide(seq_id)

    def held(self, seq_id: int) -> int:
        """Cells ``seq_id`` holds: its positions less those behind the window it gave back (0
        for a sequence out of the pool)."""
        if not self.pool.has_sequence(seq_id):
            return 0
        return self.pool.seq_len(seq_id) - self.pool.released_cells(seq_id)

    def window_cells(self, rows: int) -> int:
        """The most cells a sequence holds while ``rows`` rows of it are computed: its last
        ``window - 1`` positions and the rows, on pages that need not start aligned."""
        assert self.window is not None
        pages = -(-(self.window - 1 + rows) // self.page_size) + 1
        return pages * self.page_size

    def held_after(self, n_cells: int, rows: int) -> int:
        """The cells a sequence spanning ``n_cells`` holds once ``rows`` more are computed."""
        total = n_cells + rows
        return total if self.window is None else min(total, self.window_cells(rows))

    def window_rows(self) -> int | None:
        """The most rows one step may give a sequence so that it fits the pool alone beside its
        window (None without a window: a sequence never outgrows its context's cells)."""
        if self.window is None:
            return None
        return max(1, self.pool.n_cells - self.window_cells(0))

    def reserve(self, seq: Sequence, rows: int) -> bool:
        """Cells for the next ``rows`` rows of ``seq``, all or none."""
        try:
            self.pool.reserve(seq.seq_id, seq.num_computed + rows)
        except PoolFullError:
            return False
        # sized never to run short (window_space.py); were it to, the rows wait as for the pool
        return self.space is None or self.space.reserve(seq.seq_id, seq.num_computed + rows)

    def fit_rows(self, seq: Sequence, rows: int, keep: int = 0) -> int:
        """Reserve cells for up to ``rows`` rows of ``seq``, leaving ``keep`` cells free (whole
        pages, promised to this step's forks); returns how many rows got cells."""
        new = self.pool.pages_needed(seq.seq_id, seq.num_computed + rows) * self.page_size
        if self.pool.can_fit(keep + new) and self.reserve(seq, rows):
            return rows
        spare = self.pool.cells_free() - keep + self._tail_room(seq)
        rows = min(rows, spare)
        if rows > 0 and self.reserve(seq, rows):
            return rows
        return 0

    def _tail_room(self, seq: Sequence) -> int:
        held = self.pool.seq_len(seq.seq_id)
        return (-held) % self.page_size

    def admission_fits(self, cells: int, running: list[Request], promised: int = 0) -> bool:
        """Whether a new sequence taking ``cells`` free or cached cells fits now, beside the
        ``promised`` cells this step's forks will copy into."""
        # keep a page of headroom for every decoding sequence, so admitting does not starve them
        decoding = sum(len(r.live_sequences) for r in running)
        return self.pool.can_fit(cells + promised + decoding * self.page_size)

    def family_room(self, req: Request, running: list[Request], chunk: int) -> bool:
        """Whether an ``n > 1`` head may join the running ``n > 1`` requests: only if all of them
        can hold their most cells (:meth:`family_cells`) at once. Once its prompt has forked, a
        family never parks (its choices share pages still being written), so two that outgrew
        the pool together would stall each other until one failed; anyone else can be parked."""
        if req.params.n == 1:
            return True
        families = [r for r in running if r.params.n > 1]
        if not families:  # alone it fails only where it could not fit an empty pool either
            return True
        cells = sum(
            self.family_cells(len(r.prompt_ids), _choices_left(r), r.params.max_tokens, chunk)
            for r in (*families, req)
        )
        return cells <= self.pool.n_cells

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

    def forks_after(self, req: Request, seq: Sequence, rows: int) -> int:
        """The cells the fork copies when ``rows`` rows of ``seq`` run: its ``n > 1`` prompt's
        last rows (0 for any other chunk)."""
        if rows < seq.pending_rows or len(req.sequences) >= req.params.n:
            return 0
        return self.fork_copy_cells(req.params.n - len(req.sequences) + 1, len(seq.tokens))

    def family_cells(self, prompt_len: int, n: int, max_tokens: int, chunk: int) -> int:
        """The most cells an ``n > 1`` request can ever hold: its prompt's full pages, shared, and
        each choice's own pages from the partly used one to its last stored token (its last
        draw is never stored); behind a sliding window, no choice more than its window, nor the
        prompt more than one ``chunk``'s."""
        ps = self.page_size
        shared = prompt_len // ps
        own = -(-(prompt_len + max_tokens - 1) // ps) - shared
        cells = (shared + n * own) * ps
        if self.window is None:
            return cells
        return min(cells, max(n * self.window_cells(1), self.window_cells(chunk)))

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
        ids, starts, rows = (
            [i.seq_id for i in items],
            [i.start for i in items],
            [len(i.token_ids) for i in items],
        )
        slot_mapping, tables = self.pool.export_step(ids, starts, rows)
        if self.space is None:
            return StepPlan(items, slot_mapping, tables, copies)
        window_slots, window_tables = self.space.pool.export_step(ids, starts, rows)
        return StepPlan(items, slot_mapping, tables, copies, window_slots, window_tables)
