"""Parking's copies on a CUDA stream of their own (``CudaTransfers``), through pinned host
buffers; the picture and the buffer layout are in preempt/copies.py, which imports this module
only for a CUDA pool (the CPU server runs without torch)."""

from __future__ import annotations

import logging

import torch

from kvpark.model.ops.kv_cache import KVCache
from kvpark.preempt.sync_copies import SyncTransfers
from kvpark.preempt.transfer import CellCopier, Transfer

log = logging.getLogger("kvpark.preempt.buffers")
PROBE_BYTES = 1 << 20  # pinned at start to learn whether this host can pin at all


class CudaTransfer:
    """A copy on the copy stream, known by the event recorded after it."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self._event.synchronize()


class CudaTransfers:
    """Copies on a CUDA stream of their own, through pinned host buffers.

    Device temporaries (the index, the gathered state) are allocated while the copy stream is
    current, so the caching allocator hands their memory out again only to later work on that
    same stream, after this copy: they need not be kept alive until it lands.
    """

    asynchronous = True

    def __init__(self, copier: CellCopier, kv: KVCache) -> None:
        self._copier = copier
        self._kv = kv
        self._device = kv.k[0].device
        self._stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
        self._sync = SyncTransfers(copier)

    def host_buffer(self, n_bytes: int) -> torch.Tensor:
        try:
            buf: torch.Tensor = self._copier.host_buffer(n_bytes)  # pinned for a CUDA pool
            return buf
        except RuntimeError as e:  # cudaHostAlloc refused: pageable memory still parks, in sync
            log.warning(
                "could not pin %.1f MiB for a park (%s); using pageable memory", n_bytes / 2**20, e
            )
            elem = self._kv.k[0].element_size()
            return torch.empty(-(-n_bytes // elem), dtype=self._kv.k[0].dtype)

    def overlaps(self, buf: torch.Tensor) -> bool:
        return buf.is_pinned()

    def _index(self, cells: list[int]) -> torch.Tensor:
        # From pinned memory, so its copy to the device neither blocks nor waits for the stream.
        host = torch.tensor(cells, dtype=torch.int64).pin_memory()
        return host.to(self._device, non_blocking=True)

    @torch.inference_mode()
    def save(self, cells: list[int], out: torch.Tensor) -> Transfer:
        if not out.is_pinned() or self._kv.split:  # a window space's layout: copied in line
            return self._sync.save(cells, out)
        compute = torch.cuda.current_stream(self._device)
        with torch.cuda.stream(self._stream):
            idx = self._index(cells)
            self._stream.wait_stream(compute)  # the steps that wrote these cells have run
            states = self._kv.gather_cells(idx)
            self._kv.cell_view(out, len(cells)).copy_(states, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        return CudaTransfer(event)

    @torch.inference_mode()
    def restore(self, src: torch.Tensor, cells: list[int], first: int = 0) -> Transfer:
        if not src.is_pinned() or self._kv.split:
            return self._sync.restore(src, cells, first)
        compute = torch.cuda.current_stream(self._device)
        with torch.cuda.stream(self._stream):
            idx = self._index(cells[first:])
            states = self._kv.cell_view(src, len(cells))[:, first:]
            states = states.to(self._device, non_blocking=True)
            # fresh cells: a step still queued may read them for the sequence that just left
            self._stream.wait_stream(compute)
            self._kv.scatter_cells(idx, states)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        return CudaTransfer(event)


def cuda_transfers(copier: CellCopier, kv: object) -> CudaTransfers | None:
    """CudaTransfers for a ``KVCache`` on CUDA when the host can pin memory; None otherwise."""
    if not isinstance(kv, KVCache) or kv.k[0].device.type != "cuda":
        return None
    try:
        pinned = copier.host_buffer(PROBE_BYTES).is_pinned()
    except (MemoryError, RuntimeError):
        pinned = False
    if not pinned:
        log.info(
            "preemption: host memory here is pageable, so a copy would block the decode; "
            "parking and resuming synchronously"
        )
        return None
    log.info("preemption: parking and resuming asynchronously through pinned host memory")
    return CudaTransfers(copier, kv)
