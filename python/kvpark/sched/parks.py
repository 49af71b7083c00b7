"""The scheduler's half of a park: a request leaves the pool but keeps its slot, waits out a copy in
flight, and comes back into fresh pages (``preempt/moves.py`` drives these, ``Scheduler`` has them).

::

    running ──park──────────────────────────────► parked   recompute, or a swap whose copy landed
    running ──hold(PARKING)──► transferring ──park──► parked   a swap's copy out in flight
    parked ──resume──► running ──hold(RESTORING)──► transferring ──land──► running
"""

from __future__ import annotations

from kvpark._core import KvPool, PoolFullError
from kvpark.sched.cells import StepCells
from kvpark.sched.request import ParkMode, Request, RequestState


class Parks:
    """Mixed into ``Scheduler``, whose groups these move requests between."""

    pool: KvPool
    cells: StepCells
    running: list[Request]  # hold cells, in arrival order
    parked: list[Request]  # hold a slot but no cells
    transferring: list[Request]  # parking or restoring: hold cells, take no step

    def park(self, req: Request, mode: ParkMode) -> None:
        """Take a running request out of the pool; it keeps its slot.

        note: call only after a swap has copied the cells out: they are handed out again at once.
        A request whose copy out is in flight waits in ``transferring`` (``hold``) until then.
        """
        group = self.transferring if req in self.transferring else self.running
        assert req in group and len(req.sequences) == 1, "only a lone sequence parks"
        seq = req.sequences[0]
        req.park.released = self.pool.released_cells(seq.seq_id) if mode == "swap" else 0
        space = self.cells.space
        req.park.window_released = space.released(seq.seq_id) if space and mode == "swap" else 0
        self.cells.free_sequence(seq.seq_id)
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
        seq, space, salt = req.sequences[0], self.cells.space, req.params.cache_salt
        window_cells: list[int] = []  # a swap's cells in the window space (window_space.py)
        if space is not None and req.park.mode == "swap":
            n, first = seq.num_computed, req.park.window_released
            window_cells = space.restore(seq.seq_id, salt, first, n)
        elif space is not None:
            space.add(seq.seq_id, salt)
        self.pool.add_sequence(seq.seq_id, salt)
        hit, first = 0, req.park.released  # a swap saved its cells from `first` on
        if req.park.mode == "swap" and take_cached and not first and space is None:
            n = seq.num_computed
            hit = self.pool.match_prefix(seq.seq_id, seq.tokens[:n], n)
        if req.park.mode == "recompute":
            # the replay starts after whatever prefix of its tokens is still cached
            seq.num_computed = self.cells.match_prefix(
                seq.seq_id, seq.tokens, len(seq.tokens) - 1, salt
            )
            req.park.dropped = max(0, req.park.dropped - seq.num_computed)
            self.cells.slide(seq.seq_id)
        elif first:
            self.pool.release_before(seq.seq_id, first)  # it comes back into its later pages
        try:
            self.pool.reserve(seq.seq_id, seq.num_computed)
        except PoolFullError:
            self.cells.free_sequence(seq.seq_id)
            if req.park.mode == "recompute":
                req.park.dropped += seq.num_computed
                seq.num_computed = 0
            raise
        self.land(req)
        first = self.pool.released_cells(seq.seq_id)  # a replay may start behind its window too
        cells = self.pool.slot_mapping(seq.seq_id, first, seq.num_computed - first)
        return cells + window_cells, hit  # a saved state's order: the pool's cells, then these

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

    def register_restored(self, req: Request) -> None:
        """A resumed request's cells are written (a swap's copy back has landed): their full
        pages may be found again. A recompute's cached prefix is registered already."""
        seq = req.sequences[0]
        done = self.pool.registered_len(seq.seq_id)
        self.cells.register_tokens(seq.seq_id, seq.tokens[done : seq.num_computed])
