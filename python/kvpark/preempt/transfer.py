"""What a copy of parked cells is made of: the runner members it copies through (``CellCopier``),
the handle of a copy that may still be in flight (``Transfer``), and the ways of copying
(``Transfers``: at once in ``sync_copies.py``, on a CUDA stream in ``cuda_copies.py``; which one
parking gets: ``copies.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

# A host buffer a runner's ``host_buffer`` made: a numpy array or a torch tensor (torch is
# imported only by the CUDA copies, preempt/cuda_copies.py: the CPU server runs without it)
HostBuffer = Any


class CellCopier(Protocol):
    """What parking needs from a runner (the parking members of ``kvpark.Runner``): copy cells out
    to a host tensor and back."""

    def bytes_per_cell(self) -> int: ...

    def host_buffer(self, n_bytes: int) -> HostBuffer: ...

    def save_cells(self, cells: list[int], out: HostBuffer) -> None: ...

    def restore_cells(self, src: HostBuffer, cells: list[int]) -> None: ...


class Transfer(Protocol):
    """A copy that may still be in flight."""

    def done(self) -> bool:
        """True once the copy has landed; never blocks."""
        ...

    def wait(self) -> None:
        """Block until the copy has landed."""
        ...


class Landed:
    """A copy that finished before its handle was returned."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


LANDED = Landed()


class Transfers(Protocol):
    """How parking copies cells: synchronously, or with the copy in flight beside the decode."""

    @property
    def asynchronous(self) -> bool:
        """Whether a copy through a buffer that ``overlaps`` can still be in flight on return."""
        ...

    def host_buffer(self, n_bytes: int) -> HostBuffer:
        """A host buffer of at least ``n_bytes``; MemoryError or RuntimeError when refused."""
        ...

    def overlaps(self, buf: HostBuffer) -> bool:
        """Whether a copy through ``buf`` can run beside the decode (pinned memory on CUDA)."""
        ...

    def save(self, cells: list[int], out: HostBuffer) -> Transfer: ...

    def restore(self, src: HostBuffer, cells: list[int], first: int = 0) -> Transfer:
        """Copy the saved state's cells ``first..`` into ``cells[first:]`` (``first`` > 0 only
        where the runner's ``restore_cells`` takes it: ``copies.restores_from_cell``)."""
        ...
