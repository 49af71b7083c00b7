"""Host buffers for swap parks, and the copies of a sequence's cells out of the pool and back.

Who owns what during a park::

    running    pool pages ──(save_cells)──► slot buffer; then the pool pages are freed
    parked     nothing in the pool; K and V of cells 0..n-1 sit in the slot's host buffer
    resuming   fresh pages anywhere ◄──(restore_cells)── slot buffer (kept by the slot)

With asynchronous transfers (``preempt/copies.py``: a CUDA copy stream and pinned buffers) the copy
is still in flight when ``swap_out`` / ``swap_in`` return: the request is then ``parking`` (its
cells stay held until ``landed``) or ``restoring`` (its fresh cells are not read until ``landed``).
A slot has at most one copy in flight; ``release`` and ``wait`` wait for it, so neither a buffer nor
a cell is ever handed out under a copy.

A buffer belongs to a slot and is kept after a resume (the slot's next park reuses it), so
``held_bytes`` is the sum of capacities: that is what ``--preempt-ram`` bounds. Idle buffers (their
slot is not parked) are given back when the planner says so, to let another slot park. A recompute
park holds nothing: its tokens are replayed as prompt rows on resume.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvpark.preempt.copies import restores_from_cell
from kvpark.preempt.sync_copies import SyncTransfers
from kvpark.preempt.transfer import CellCopier, HostBuffer, Transfer, Transfers

log = logging.getLogger("kvpark.preempt.buffers")


@dataclass
class SwapState:
    """A swapped-out sequence: its cells' K and V live in ``slot``'s buffer."""

    slot: int
    n_cells: int
    n_bytes: int


class Parking:
    def __init__(
        self,
        copier: CellCopier,
        n_slots: int,
        fail_save: bool = False,
        transfers: Transfers | None = None,
    ) -> None:
        self._copier = copier
        self._buffers: list[HostBuffer | None] = [None] * n_slots
        self._fail_save = fail_save  # test knob KVPARK_PREEMPT_FAIL_SAVE
        self._sync = SyncTransfers(copier)
        # public so that tests can put in a fake whose copies land after a few polls
        self.transfers: Transfers = transfers if transfers is not None else self._sync
        self._copies: dict[int, Transfer] = {}  # slot -> its copy in flight
        # whether a resume may leave its cached prefix alone and copy back only the rest
        self.restores_from_cell = restores_from_cell(copier)
        self._pageable: set[int] = set()  # slots that got pageable memory: synchronous for good

    @property
    def asynchronous(self) -> bool:
        """Whether every park copies asynchronously (``/props.preempt.async``)."""
        return self.transfers.asynchronous and not self._pageable

    def in_flight(self, slot: int) -> bool:
        return slot in self._copies

    def landed(self, slot: int) -> bool:
        """Poll the slot's copy without blocking; True once it has landed (or none is in flight)."""
        transfer = self._copies.get(slot)
        if transfer is not None and not transfer.done():
            return False
        self._copies.pop(slot, None)
        return True

    def wait(self, slot: int) -> None:
        """Block until the slot's copy, if one is in flight, has landed."""
        transfer = self._copies.pop(slot, None)
        if transfer is not None:
            transfer.wait()

    @property
    def held_bytes(self) -> int:
        return sum(self.capacity(s) for s in range(len(self._buffers)))

    def capacities(self) -> list[int]:
        return [self.capacity(s) for s in range(len(self._buffers))]

    def capacity(self, slot: int) -> int:
        buf = self._buffers[slot]
        return 0 if buf is None else int(buf.nbytes)

    def state_bytes(self, n_cells: int) -> int:
        return n_cells * self._copier.bytes_per_cell()

    def release(self, slot: int) -> int:
        """Give a slot's buffer back; returns the bytes freed."""
        self.wait(slot)  # never free host memory a copy still reads or writes
        freed = self.capacity(slot)
        self._buffers[slot] = None
        return freed

    def swap_out(
        self, slot: int, cells: list[int], capacity: int, positions: int | None = None
    ) -> SwapState | None:
        """Copy ``cells`` (a sequence's cells in logical order) into the slot's buffer;
        ``positions``: the positions they hold, where that is fewer (a window space's cells
        follow the pool's, sched/window_space.py, no more of them than of the pool's: the
        state then takes at most ``positions`` cells' bytes of every layer).

        Returns None when the host memory cannot be had, or the runner could not save the state
        (``save_cells`` raised ``MemoryError``: a tensor-parallel rank could not save its share);
        the caller then parks by recompute.
        """
        need = self.state_bytes(len(cells) if positions is None else positions)
        if self.capacity(slot) < need:
            try:
                if self._fail_save:
                    raise MemoryError("KVPARK_PREEMPT_FAIL_SAVE=1")
                self._buffers[slot] = None
                self._buffers[slot] = self.transfers.host_buffer(max(capacity, need))
            except (MemoryError, RuntimeError) as e:
                log.warning(
                    "could not take the host memory for a %.1f MiB park: %s", need / 2**20, e
                )
                return None
        buf = self._buffers[slot]
        assert buf is not None
        if cells:
            try:
                self._start(slot, buf, lambda mover: mover.save(cells, buf))
            except MemoryError as e:  # not saved, the cells still whole: recompute instead
                log.warning("a %.1f MiB park could not be saved: %s", need / 2**20, e)
                return None
        return SwapState(slot, len(cells), need)

    def swap_in(self, slot: int, cells: list[int], first: int = 0) -> None:
        """Copy the slot's swapped state back into ``cells`` (fresh, in logical order); with
        ``first`` (only where ``restores_from_cell``), just its cells ``first..``: the ones
        before are cached pages the resume took by hash."""
        buf = self._buffers[slot]
        assert buf is not None, "a parked slot keeps its buffer"
        assert first == 0 or self.restores_from_cell, "this runner restores whole states only"
        if not cells[first:]:
            return
        if first:
            self._start(slot, buf, lambda m: m.restore(buf, cells, first))
        else:  # a whole state through the two-argument call every Transfers has
            self._start(slot, buf, lambda m: m.restore(buf, cells))

    def _start(self, slot: int, buf: HostBuffer, copy: Callable[[Transfers], Transfer]) -> None:
        assert slot not in self._copies, "one copy in flight per slot"
        mover = self.transfers if self._overlaps(slot, buf) else self._sync
        transfer = copy(mover)
        if mover.asynchronous:
            self._copies[slot] = transfer
        else:
            transfer.wait()

    def _overlaps(self, slot: int, buf: HostBuffer) -> bool:
        if not self.transfers.asynchronous or slot in self._pageable:
            return False
        if self.transfers.overlaps(buf):
            return True
        self._pageable.add(slot)
        log.warning(
            "the host memory for a %.3f MiB park is pageable, so slot %d parks synchronously "
            "from now on",
            buf.nbytes / 2**20,
            slot,
        )
        return False
