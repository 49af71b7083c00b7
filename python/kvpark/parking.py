"""Host buffers for swap parks, and the copies of a sequence's cells out of the pool and back.

Who owns what during a park::

    running    pool pages ──(save_cells)──► slot buffer; then the pool pages are freed
    parked     nothing in the pool; K and V of cells 0..n-1 sit in the slot's host buffer
    resuming   fresh pages anywhere ◄──(restore_cells)── slot buffer (kept by the slot)

A buffer belongs to a slot and is kept after a resume (the slot's next park reuses it), so
``held_bytes`` is the sum of capacities: that is what ``--preempt-ram`` bounds. Idle buffers (their
slot is not parked) are given back when the planner says so, to let another slot park. A recompute
park holds nothing: its tokens are replayed as prompt rows on resume.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger("kvpark.parking")


class CellCopier(Protocol):
    """What parking needs from a runner: copy cells out to a host tensor and back."""

    def bytes_per_cell(self) -> int: ...

    def host_buffer(self, n_bytes: int) -> torch.Tensor: ...

    def save_cells(self, cells: list[int], out: torch.Tensor) -> None: ...

    def restore_cells(self, src: torch.Tensor, cells: list[int]) -> None: ...


@dataclass
class SwapState:
    """A swapped-out sequence: its cells' K and V live in ``slot``'s buffer."""

    slot: int
    n_cells: int
    n_bytes: int


class Parking:
    def __init__(self, copier: CellCopier, n_slots: int, fail_save: bool = False) -> None:
        self._copier = copier
        self._buffers: list[torch.Tensor | None] = [None] * n_slots
        self._fail_save = fail_save  # test knob KVPARK_PREEMPT_FAIL_SAVE

    @property
    def held_bytes(self) -> int:
        return sum(self.capacity(s) for s in range(len(self._buffers)))

    def capacities(self) -> list[int]:
        return [self.capacity(s) for s in range(len(self._buffers))]

    def capacity(self, slot: int) -> int:
        buf = self._buffers[slot]
        return 0 if buf is None else buf.numel() * buf.element_size()

    def state_bytes(self, n_cells: int) -> int:
        return n_cells * self._copier.bytes_per_cell()

    def release(self, slot: int) -> int:
        """Give a slot's buffer back; returns the bytes freed."""
        freed = self.capacity(slot)
        self._buffers[slot] = None
        return freed

    def swap_out(self, slot: int, cells: list[int], capacity: int) -> SwapState | None:
        """Copy ``cells`` (a sequence's cells in logical order) into the slot's buffer.

        Returns None when the host memory cannot be had; the caller then parks by recompute.
        """
        need = self.state_bytes(len(cells))
        if self.capacity(slot) < need:
            try:
                if self._fail_save:
                    raise MemoryError("KVPARK_PREEMPT_FAIL_SAVE=1")
                self._buffers[slot] = None
                self._buffers[slot] = self._copier.host_buffer(max(capacity, need))
            except (MemoryError, RuntimeError) as e:
                log.warning(
                    "could not take the host memory for a %.1f MiB park: %s", need / 2**20, e
                )
                return None
        buf = self._buffers[slot]
        assert buf is not None
        if cells:
            self._copier.save_cells(cells, buf)
        return SwapState(slot, len(cells), need)

    def swap_in(self, slot: int, cells: list[int]) -> None:
        """Copy the slot's swapped state back into ``cells`` (fresh, in logical order)."""
        buf = self._buffers[slot]
        assert buf is not None, "a parked slot keeps its buffer"
        if cells:
            self._copier.restore_cells(buf, cells)
