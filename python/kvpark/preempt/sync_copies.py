"""Parking's copies done at once, through the runner (any device, any runner): each has landed when
its handle is returned."""

from __future__ import annotations

from kvpark.preempt.transfer import LANDED, CellCopier, HostBuffer, Transfer


class SyncTransfers:
    """Every copy at once, through the runner's ``save_cells`` / ``restore_cells``."""

    asynchronous = False

    def __init__(self, copier: CellCopier) -> None:
        self._copier = copier

    def host_buffer(self, n_bytes: int) -> HostBuffer:
        return self._copier.host_buffer(n_bytes)

    def overlaps(self, buf: HostBuffer) -> bool:
        return False

    def save(self, cells: list[int], out: HostBuffer) -> Transfer:
        self._copier.save_cells(cells, out)
        return LANDED

    def restore(self, src: HostBuffer, cells: list[int], first: int = 0) -> Transfer:
        if first:
            self._copier.restore_cells(src, cells, first=first)  # type: ignore[call-arg]
        else:
            self._copier.restore_cells(src, cells)
        return LANDED
