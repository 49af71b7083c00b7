"""Chooses each step's rows: decodes first, then prompt chunks, then new requests, within the row
budget.

The scheduler owns the Rust pool (``kvpark._core.KvPool``) and never touches tensors. Its output is
a :class:`~kvpark.sched.plan.StepPlan` of plain data. There is no prefill or decode phase: every
sequence's computed tokens catch up with its known tokens, a decode being a catch-up of one row.

Slots: a request takes ``n`` slots (one per choice) from admission until it finishes. Admission is
FIFO and nobody passes a head that does not fit yet (the rule: ``wait_queue.py``); reserving the
step's cells and exporting its plan: ``cells.py``; a park's way out of the pool and back:
``parks.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvpark._core import KvPool
from kvpark.config.layers import PoolConfig, SchedulerConfig
from kvpark.sched.cells import StepCells, step_item
from kvpark.sched.parks import Parks
from kvpark.sched.plan import StepItem, StepPlan
from kvpark.sched.request import Request, RequestState, Sequence
from kvpark.sched.wait_queue import WaitQueue
from kvpark.sched.window_space import WindowSpace

CONTEXT_ERROR = "Context size has been exceeded."
log = logging.getLogger("kvpark.sched")


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


class Scheduler(Parks):
    def __init__(
        self,
        pool_config: PoolConfig,
        config: SchedulerConfig,
        max_model_len: int,
        prefix_cache_salt: int | None = None,
        window: int | None = None,
        window_space: tuple[int, int] | None = None,
    ) -> None:
        """``prefix_cache_salt``: turn the pool's prefix cache on under this salt (it stands for
        everything besides the tokens that changes a cell's K and V: the model, its arithmetic,
        exact mode); None: off. ``window``: every layer of the model attends over its last
        ``window`` positions only, so the pages behind it leave the pool (cells.py).
        ``window_space``: (window, cells) of the sliding layers' own cell space, for a model
        that mixes them with global layers (window_space.py)."""
        self.config = config
        self.max_model_len = max_model_len
        self.pool = KvPool(
            pool_config.kv_cells,
            pool_config.page_size,
            prefix_cache_salt=prefix_cache_salt,
            window=window,
        )
        self.cache = PrefixCacheCounts()
        self.page_size = pool_config.page_size
        space = None
        if window_space is not None:
            w, n = window_space
            space = WindowSpace(n, self.page_size, w, pool_config.kv_cells, prefix_cache_salt)
        self.cells = StepCells(self.pool, self.page_size, window, space)
        self.waiting = WaitQueue()
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
        self.cells.free_sequence(seq.seq_id)
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.transferring or self.parked)

    @property
    def free_slot_count(self) -> int:
        return len(self._free_slots)

    @property
    def open_slots(self) -> int:
        """Free slots less those that admitted ``n > 1`` requests will take when their prompt
        forks: what admission may hand out."""
        held = (*self.running, *self.transferring, *self.parked)
        return self.free_slot_count - sum(r.params.n - len(r.sequences) for r in held)

    def wait_queue_full(self, n: int) -> bool:
        """Whether a new request of ``n`` choices would queue past ``--max-waiting`` requests
        (``WaitQueue.queued_beyond_slots``)."""
        return self.waiting.queued_beyond_slots(self.open_slots, n) > self.config.max_waiting

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
        cap = self.cells.window_rows() or budget
        for req in self.running:
            seq = req.sequences[0]
            if len(req.sequences) == 1 and seq.pending_rows > 1 and budget > 0:
                rows[seq.seq_id] = rows_wanted(seq, min(budget, cap))
                budget -= rows[seq.seq_id]
        return rows

    def schedule(
        self, report_shortfall: bool = False, rows: dict[int, int] | None = None
    ) -> tuple[StepPlan, StepOutcome]:
        """Reserve cells and build the step from ``rows`` (None: :meth:`next_rows` now). With
        ``report_shortfall``, decodes that do not fit return an empty plan and the missing cells
        instead (preemption then parks victims and asks again). Without it, a request whose
        decode finds no cell sits the step out while others run and free cells (a family, which
        cannot park, or anyone with preemption off); only when nothing else can run does the
        newest such request fail."""
        outcome = StepOutcome()
        rows = self.next_rows() if rows is None else rows
        if report_shortfall:
            outcome.shortfall = self.cells.decode_shortfall(rows, self.by_seq)
            if outcome.shortfall > 0:
                return self._export([]), outcome
        items: list[StepItem] = []
        stalled: list[Request] = []  # a decode found no cell: the request sits this step out
        for req in self.running:
            decodes = []
            for seq in req.live_sequences:
                if rows.get(seq.seq_id, 0) == 1 and seq.pending_rows == 1:
                    if not self.cells.reserve(seq, 1):
                        stalled.append(req)  # all its choices wait: they draw in lockstep
                        break
                    decodes.append(step_item(seq, 1))
            else:
                items += decodes
        budget = self.config.max_batch_tokens - len(items)
        # the cells the forks of n > 1 prompts finishing this step will copy into: no later chunk
        # or admission of the step may take them (the fork runs after the step, and would fail)
        promised = 0
        for req in self.running:
            seq = req.sequences[0]
            want = min(rows.get(seq.seq_id, 0), budget)
            if seq.pending_rows > 1 and want > 0:
                got = self.cells.fit_rows(seq, want, keep=promised)
                if got > 0:
                    promised += self.cells.forks_after(req, seq, got)
                    items.append(step_item(seq, got))
                    budget -= got
        if not stalled:  # a newcomer would take the cells a stalled decode waits for
            self._admit(items, budget, outcome, promised)
        elif not items and not self.transferring:
            # a real overflow: nothing runs that could free a cell, so the newest stalled
            # request fails and the others wait for its cells
            newest = stalled[-1]
            log.warning("request %s lacks a cell, nothing runs: failing it", newest.request_id)
            outcome.failed.append(newest)
            self.release(newest)
        return self._export(items), outcome

    def _admit(
        self, items: list[StepItem], budget: int, outcome: StepOutcome, promised: int
    ) -> None:
        """FIFO admission: a head that does not fit blocks the queue, and so does a parked request
        (parked requests come back before anyone new is let in)."""
        while budget > 0 and not self.parked and not self.transferring:
            if not self.waiting.head_gets_slots(self.open_slots):
                return
            req = self.waiting.head
            # the last prompt token is always computed: its row gives the first draw
            prompt, reusable = req.prompt_ids, len(req.prompt_ids) - 1
            salt = req.params.cache_salt
            hit = self.cells.prefix_hit(prompt, reusable, salt)
            if self.cells.space is not None:
                reusable = hit  # the window space's cached pages may end sooner than the pool's
            rows = min(len(prompt) - hit, budget, self.cells.window_rows() or budget)
            need = self.pool.cells_to_admit(prompt, reusable, hit + rows, salt)
            if self.cells.window is not None:  # its hit's pages behind the window go back
                need = min(need, self.cells.window_cells(rows))
            if hit + rows == len(prompt):  # the whole prompt this step: its fork copies too
                need += self.cells.fork_copy_cells(req.params.n, len(prompt))
            if not self.cells.family_room(req, self.running, self.config.max_batch_tokens):
                return
            if not self.cells.admission_fits(need, self.running, promised):
                if not self.running and not items:
                    self.waiting.pop_head()
                    log.warning("request %s cannot fit an empty pool: failing it", req.request_id)
                    outcome.failed.append(req)
                    continue
                return
            self.waiting.pop_head()
            seq = self._new_sequence(req, index=0, tokens=list(prompt))
            seq.num_computed = req.cached_tokens = self.cells.match_prefix(
                seq.seq_id, prompt, reusable, salt
            )
            self.cells.slide(seq.seq_id)
            self.cache.queries += len(prompt)
            self.cache.hits += seq.num_computed
            req.sequences = [seq]
            req.state = RequestState.RUNNING
            self.running.append(req)
            rows = self.cells.fit_rows(seq, rows, keep=promised)
            promised += self.cells.forks_after(req, seq, rows)
            items.append(step_item(seq, rows))
            budget -= rows

    def register(self, plan: StepPlan) -> None:
        """After a step has run: the cells its rows wrote hold K and V, so their full pages may be
        found by later prompts (a no-op with the prefix cache off); then the pages behind a
        sliding window leave (registered first, so they are cached rather than lost)."""
        if self.pool.prefix_cache_salt is not None and plan.items:
            self.cells.register_step(
                [i.seq_id for i in plan.items], [i.token_ids for i in plan.items]
            )
        for item in plan.items:
            self.cells.slide(item.seq_id)

    def _export(self, items: list[StepItem]) -> StepPlan:
        copies, self._pending_copies = self._pending_copies, []
        return self.cells.export(items, copies)

    # ----------------------------------------------------------------- sequences
    def _new_sequence(self, req: Request, index: int, tokens: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, index, len(req.prompt_ids), tokens)
        self._next_seq_id += 1
        self.cells.add_sequence(seq.seq_id, req.params.cache_salt)
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
            self._pending_copies += self.cells.fork(parent.seq_id, child.seq_id)
            child.num_computed = parent.num_computed
            self.slot_of[child.seq_id] = self._free_slots.pop()
            self.by_seq[child.seq_id] = (req, child)
            req.sequences.append(child)
        parent.tokens.append(first_tokens[0])
