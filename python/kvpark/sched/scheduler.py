"""Chooses each step's rows: decodes first, then prompt chunks, then new requests, within the row
budget.

The scheduler owns the Rust pool (``kvpark._core.KvPool``) and never touches tensors. Its output is
a :class:`~kvpark.sched.plan.StepPlan` of plain data. There is no prefill or decode phase: every
sequence's computed tokens catch up with its known tokens, a decode being a catch-up of one row.

Slots: a request takes ``n`` slots (one per choice) from admission until it finishes. Admission is
FIFO and nobody passes a head that does not fit yet.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvpark._core import KvPool, PoolFullError
from kvpark.config.layers import PoolConfig, SchedulerConfig
from kvpark.sched.plan import StepItem, StepPlan
from kvpark.sched.request import ParkMode, Request, RequestState, Sequence

CONTEXT_ERROR = "Context size has been exceeded."


@dataclass
class PrefixCacheCounts:
    """Prompt tokens looked up in the prefix cache at admission, and those found (the
    ``kvpark_prefix_cache_queries_total`` / ``_hits_total`` counters)."""

    queries: int = 0
    hits: int = 0


@dataclass
class StepOutcome:
    """What scheduling decided besides the plan: requests that cannot continue."""

    failed: list[Request] = field(default_factory=list)
    shortfall: int = 0  # cells the decodes lack (only when asked to report it instead of failing)


def rows_wanted(seq: Sequence, budget: int) -> int:
    """The next-rows rule, for one sequence with ``budget`` rows left in the step: a decode takes
    one row, a prompt chunk or a replay as many of its pending rows as the budget allows. The
    Rust simulator (rust/sim) mirrors it as its test oracle."""
    return 1 if seq.pending_rows == 1 else min(seq.pending_rows, budget)


class Scheduler:
    def __init__(
        self,
        pool_config: PoolConfig,
        config: SchedulerConfig,
        max_model_len: int,
        prefix_cache_salt: int | None = None,
    ) -> None:
        """``prefix_cache_salt``: turn the pool's prefix cache on under this salt (it stands for
        everything besides the tokens that changes a cell's K and V: the model, its arithmetic,
        exact mode); None: off."""
        self.config = config
        self.max_model_len = max_model_len
        self.pool = KvPool(
            pool_config.kv_cells, pool_config.page_size, prefix_cache_salt=prefix_cache_salt
        )
        self.cache = PrefixCacheCounts()
        self.page_size = pool_config.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # hold cells, in arrival order
        self.parked: list[Request] = []  # hold a slot but no cells
        self.transferring: list[Request] = []  # parking or restoring: hold cells, take no step
        self.slot_of: dict[int, int] = {}  # seq_id -> slot id
        self._free_slots = list(range(config.parallel - 1, -1, -1))
        self._next_seq_id = 1
        self._pending_copies: list[tuple[int, int]] = []
        self.by_seq: dict[int, tuple[Request, Sequence]] = {}  # every sequence of a running request

    # ----------------------------------------------------------------- requests in and out
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.state = RequestState.FINISHED
                return req
        for req in (*self.running, *self.transferring, *self.parked):
            if req.request_id == request_id:
                self.release(req)
                return req
        return None

    def release(self, request: Request) -> None:
        """Give back every cell and slot of a request (finished, failed or aborted)."""
        for seq in request.sequences:
            self._drop_sequence(seq)
            self.by_seq.pop(seq.seq_id, None)
        for group in (self.running, self.transferring):
            if request in group:
                group.remove(request)
        if request in self.parked:
            self.parked.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        request.state = RequestState.FINISHED

    def finish_sequence(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self._drop_sequence(seq)

    def _drop_sequence(self, seq: Sequence) -> None:
        if self.pool.has_sequence(seq.seq_id):
            self.pool.free_sequence(seq.seq_id)
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.transferring or self.parked)

    @property
    def free_slot_count(self) -> int:
        return len(self._free_slots)

    def _slots_promised(self) -> int:
        """Slots that admitted ``n > 1`` requests will take when their prompt forks."""
        held = (*self.running, *self.transferring, *self.parked)
        return sum(r.params.n - len(r.sequences) for r in held)

    # ----------------------------------------------------------------- one step
    def next_rows(self) -> dict[int, int]:
        """Rows each running sequence would compute next step: one per decode first, then prompt
        chunks oldest first within ``--max-batch-tokens`` (:func:`rows_wanted` for each). The
        planner prices the step from this, and :meth:`schedule` builds it from the same dict."""
        budget = self.config.max_batch_tokens
        rows: dict[int, int] = {}
        for req in self.running:
            for seq in req.live_sequences:
                if seq.pending_rows == 1 and budget > 0:
                    rows[seq.seq_id] = rows_wanted(seq, budget)
                    budget -= 1
        for req in self.running:
            seq = req.sequences[0]
            if len(req.sequences) == 1 and seq.pending_rows > 1 and budget > 0:
                rows[seq.seq_id] = rows_wanted(seq, budget)
                budget -= rows[seq.seq_id]
        return rows

    def schedule(
        self, report_shortfall: bool = False, rows: dict[int, int] | None = None
    ) -> tuple[StepPlan, StepOutcome]:
        """Reserve cells and build the step from ``rows`` (None: :meth:`next_rows` now). With
        ``report_shortfall``, decodes that do not fit return an empty plan and the missing cells
        instead of failing requests (preemption then parks victims and asks again)."""
        outcome = StepOutcome()
        rows = self.next_rows() if rows is None else rows
        if report_shortfall:
            outcome.shortfall = self._decode_shortfall(rows)
            if outcome.shortfall > 0:
                return self._export([]), outcome
        items: list[StepItem] = []
        for req in list(self.running):
            for seq in req.live_sequences:
                want = rows.get(seq.seq_id, 0)
                if want == 1 and seq.pending_rows == 1:
                    if not self._reserve(seq, 1):
                        outcome.failed.append(req)  # a real overflow: nobody can make room
                        self.release(req)
                        break
                    items.append(self._item(seq, 1))
        budget = self.config.max_batch_tokens - len(items)
        for req in self.running:
            seq = req.sequences[0]
            want = min(rows.get(seq.seq_id, 0), budget)
            if seq.pending_rows > 1 and want > 0:
                got = self._fit_rows(seq, want)
                if got > 0:
                    items.append(self._item(seq, got))
                    budget -= got
        self._admit(items, budget, outcome)
        return self._export(items), outcome

    def _admit(self, items: list[StepItem], budget: int, outcome: StepOutcome) -> None:
        """FIFO admission: a head that does not fit blocks the queue, and so does a parked request
        (parked requests come back before anyone new is let in)."""
        while self.waiting and budget > 0 and not self.parked and not self.transferring:
            req = self.waiting[0]
            if req.params.n > self.free_slot_count - self._slots_promised():
                return
            # the last prompt token is always computed: its row gives the first draw
            prompt, reusable = req.prompt_ids, len(req.prompt_ids) - 1
            hit, _ = self.pool.cached_prefix(prompt, reusable)
            rows = min(len(prompt) - hit, budget)
            if not self._admission_fits(self.pool.cells_to_admit(prompt, reusable, hit + rows)):
                if not self.running and not items:
                    self.waiting.popleft()
                    outcome.failed.append(req)  # cannot fit even an empty pool
                    continue
                return
            self.waiting.popleft()
            seq = self._new_sequence(req, index=0, tokens=list(prompt))
            seq.num_computed = req.cached_tokens = self.pool.match_prefix(
                seq.seq_id, prompt, reusable
            )
            self.cache.queries += len(prompt)
            self.cache.hits += seq.num_computed
            req.sequences = [seq]
            req.state = RequestState.RUNNING
            self.running.append(req)
            rows = self._fit_rows(seq, rows)
            items.append(self._item(seq, rows))
            budget -= rows

    def _decode_shortfall(self, rows: dict[int, int]) -> int:
        pages = sum(
            self.pool.pages_needed(seq_id, self.by_seq[seq_id][1].num_computed + 1)
            for seq_id, n in rows.items()
            if n == 1 and self.by_seq[seq_id][1].pending_rows == 1
        )
        return max(0, pages * self.page_size - self.pool.cells_free())

    # ----------------------------------------------------------------- parks
    def park(self, req: Request, mode: ParkMode) -> None:
        """Take a running request out of the pool; it keeps its slot.

        note: call only after a swap has copied the cells out: they are handed out again at once.
        A request whose copy out is in flight waits in ``transferring`` (``hold``) until then.
        """
        group = self.transferring if req in self.transferring else self.running
        assert req in group and len(req.sequences) == 1, "only a lone sequence parks"
        seq = req.sequences[0]
        self.pool.free_sequence(seq.seq_id)
        if mode == "recompute":
            req.park.dropped = seq.num_computed
            seq.num_computed = 0  # every known token is replayed as a prompt row
        group.remove(req)
        self.parked.append(req)
        req.state = RequestState.PARKED

    def resume(self, req: Request, take_cached: bool = False) -> tuple[list[int], int]:
        """Put a parked request back into fresh pages; returns the cells a swap restores into and
        how many of them, from the first, are cached pages it took by hash instead (only with
        ``take_cached``: the runner can restore a state from a later cell).

        Raises PoolFullError (state unchanged) when its cells do not fit."""
        seq = req.sequences[0]
        self.pool.add_sequence(seq.seq_id)
        hit = 0
        if req.park.mode == "swap" and take_cached:
            n = seq.num_computed
            hit = self.pool.match_prefix(seq.seq_id, seq.tokens[:n], n)
        if req.park.mode == "recompute":
            # the replay starts after whatever prefix of its tokens is still cached
            seq.num_computed = self.pool.match_prefix(seq.seq_id, seq.tokens, len(seq.tokens) - 1)
            req.park.dropped = max(0, req.park.dropped - seq.num_computed)
        try:
            self.pool.reserve(seq.seq_id, seq.num_computed)
        except PoolFullError:
            self.pool.free_sequence(seq.seq_id)
            if req.park.mode == "recompute":
                req.park.dropped += seq.num_computed
                seq.num_computed = 0
            raise
        self.land(req)
        return self.pool.slot_mapping(seq.seq_id, 0, seq.num_computed), hit

    def hold(self, req: Request, state: RequestState) -> None:
        """Take a running request out of the steps while a copy of its cells is in flight
        (``PARKING`` or ``RESTORING``); it keeps its cells until ``park`` or ``land``."""
        self.running.remove(req)
        self.transferring.append(req)
        req.state = state

    def land(self, req: Request) -> None:
        """Back into the steps: a parked request resumed, or a restoring one whose copy landed."""
        (self.transferring if req in self.transferring else self.parked).remove(req)
        self.running.append(req)
        self.running.sort(key=lambda r: r.key)
        req.state = RequestState.RUNNING

    def _admission_fits(self, cells: int) -> bool:
        """Whether a new sequence taking ``cells`` free or cached cells fits now."""
        # keep a page of headroom for every decoding sequence, so admitting does not starve them
        decoding = sum(len(r.live_sequences) for r in self.running)
        return self.pool.can_fit(cells + decoding * self.page_size)

    def register_restored(self, req: Request) -> None:
        """A resumed request's cells are written (a swap's copy back has landed): their full
        pages may be found again. A recompute's cached prefix is registered already."""
        seq = req.sequences[0]
        done = self.pool.registered_len(seq.seq_id)
        self.pool.register_tokens(seq.seq_id, seq.tokens[done : seq.num_computed])

    def register(self, plan: StepPlan) -> None:
        """After a step has run: the cells its rows wrote hold K and V, so their full pages may be
        found by later prompts (a no-op with the prefix cache off)."""
        if self.pool.prefix_cache_salt is not None and plan.items:
            self.pool.register_step(
                [i.seq_id for i in plan.items], [i.token_ids for i in plan.items]
            )

    def _reserve(self, seq: Sequence, rows: int) -> bool:
        try:
            self.pool.reserve(seq.seq_id, seq.num_computed + rows)
        except PoolFullError:
            return False
        return True

    def _fit_rows(self, seq: Sequence, rows: int) -> int:
        """Reserve cells for up to ``rows`` rows of ``seq``; returns how many rows got cells."""
        if self._reserve(seq, rows):
            return rows
        spare = self.pool.cells_free() + self._tail_room(seq)
        rows = min(rows, spare)
        if rows > 0 and self._reserve(seq, rows):
            return rows
        return 0

    def _tail_room(self, seq: Sequence) -> int:
        held = self.pool.seq_len(seq.seq_id)
        return (-held) % self.page_size

    def _item(self, seq: Sequence, rows: int) -> StepItem:
        start = seq.num_computed
        end = start + rows
        return StepItem(seq.seq_id, start, seq.tokens[start:end], sample=end == len(seq.tokens))

    def _export(self, items: list[StepItem]) -> StepPlan:
        copies, self._pending_copies = self._pending_copies, []
        if not items:
            return StepPlan([], [], [], copies)
        slot_mapping, tables = self.pool.export_step(
            [i.seq_id for i in items], [i.start for i in items], [len(i.token_ids) for i in items]
        )
        return StepPlan(items, slot_mapping, tables, copies)

    # ----------------------------------------------------------------- sequences
    def _new_sequence(self, req: Request, index: int, tokens: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, index, len(req.prompt_ids), tokens)
        self._next_seq_id += 1
        self.pool.add_sequence(seq.seq_id)
        self.slot_of[seq.seq_id] = self._free_slots.pop()
        self.by_seq[seq.seq_id] = (req, seq)
        return seq

    def fork(self, req: Request, first_tokens: list[int]) -> None:
        """After the prompt's last row is drawn ``n`` times: choice j continues with
        first_tokens[j].

        The children share the prompt's full pages; a partly used last page is copied (the copies
        run before the next step's rows are stored).
        """
        parent = req.sequences[0]
        for j, token in enumerate(first_tokens[1:], start=1):
            child = Sequence(self._next_seq_id, j, parent.prompt_len, [*parent.tokens, token])
            self._next_seq_id += 1
            self._pending_copies += self.pool.fork(parent.seq_id, child.seq_id)
            child.num_computed = parent.num_computed
            self.slot_of[child.seq_id] = self._free_slots.pop()
            self.by_seq[child.seq_id] = (req, child)
            req.sequences.append(child)
        parent.tokens.append(first_tokens[0])
