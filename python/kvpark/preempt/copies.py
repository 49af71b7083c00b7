"""Copies of a parked sequence's cells between the KV pool and its slot's host buffer, and the
handle by which a copy in flight is known.

::

    save(cells, out)      pool cells ──► host buffer       a park's copy out
    restore(src, cells)   host buffer ──► fresh pool cells  a resume's copy back
    -> Transfer           done(): has it landed? (never blocks)   wait(): block until it has

``SyncTransfers`` copies through the runner at once (any device, any runner): its transfers have
landed when they are returned. ``CudaTransfers`` issues the copy on a stream of its own and returns
at once, so the decode goes on while the bytes move::

    compute stream  ── step N ──┬── step N+1 ──────── step N+2 ──
                                │ waits for step N (the cells' last writer or reader)
    copy stream (park)          └─ gather cells ─► D2H into the pinned buffer ─► event
    copy stream (resume)           H2D from the pinned buffer ─► scatter into cells ─► event

A copy is only as asynchronous as its host memory: to or from pageable memory the host blocks, so a
buffer that could not be pinned is copied synchronously (``overlaps`` tells Parking which).

Host buffer layout (both implementations): ``[2 * layers, n_cells, kv_heads, head_dim]`` in the KV
dtype, layer l's K at row 2l and its V at row 2l + 1, cells in logical order.
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from kvpark.model.ops.kv_cache import KVCache

if TYPE_CHECKING:
    from kvpark.preempt.buffers import CellCopier

log = logging.getLogger("kvpark.preempt.buffers")
PROBE_BYTES = 1 << 20  # pinned at start to learn whether this host can pin at all


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

    def host_buffer(self, n_bytes: int) -> torch.Tensor:
        """A host buffer of at least ``n_bytes``; MemoryError or RuntimeError when refused."""
        ...

    def overlaps(self, buf: torch.Tensor) -> bool:
        """Whether a copy through ``buf`` can run beside the decode (pinned memory on CUDA)."""
        ...

    def save(self, cells: list[int], out: torch.Tensor) -> Transfer: ...

    def restore(self, src: torch.Tensor, cells: list[int], first: int = 0) -> Transfer:
        """Copy the saved state's cells ``first..`` into ``cells[first:]`` (``first`` > 0 only
        where the runner's ``restore_cells`` takes it: ``restores_from_cell``)."""
        ...


class SyncTransfers:
    """Every copy at once, through the runner's ``save_cells`` / ``restore_cells``."""

    asynchronous = False

    def __init__(self, copier: CellCopier) -> None:
        self._copier = copier

    def host_buffer(self, n_bytes: int) -> torch.Tensor:
        return self._copier.host_buffer(n_bytes)

    def overlaps(self, buf: torch.Tensor) -> bool:
        return False

    def save(self, cells: list[int], out: torch.Tensor) -> Transfer:
        self._copier.save_cells(cells, out)
        return LANDED

    def restore(self, src: torch.Tensor, cells: list[int], first: int = 0) -> Transfer:
        if first:
            self._copier.restore_cells(src, cells, first=first)  # type: ignore[call-arg]
        else:
            self._copier.restore_cells(src, cells)
        return LANDED


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
            return self._copier.host_buffer(n_bytes)  # pinned for a CUDA pool
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
        if not out.is_pinned():
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
        if not src.is_pinned():
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


@runtime_checkable
class DeviceKVCopier(Protocol):
    """Optional runner member (public, see docs/custom-runners.md): a runner whose cells live in a
    ``KVCache`` offers it here, and on a CUDA pool parking then copies on a stream of its own
    (asynchronous parks). A runner without it parks synchronously."""

    @property
    def kv_cache(self) -> KVCache: ...


def make_transfers(copier: CellCopier, want_async: bool) -> Transfers:
    """CudaTransfers for the built-in runner on a CUDA pool when asked and the host can pin memory;
    SyncTransfers otherwise (a custom runner's ``save_cells`` must have landed when it returns)."""
    kv = copier.kv_cache if isinstance(copier, DeviceKVCopier) else None
    if not want_async or not isinstance(kv, KVCache) or kv.k[0].device.type != "cuda":
        return SyncTransfers(copier)
    try:
        pinned = copier.host_buffer(PROBE_BYTES).is_pinned()
    except (MemoryError, RuntimeError):
        pinned = False
    if not pinned:
        log.info(
            "preemption: host memory here is pageable, so a copy would block the decode; "
            "parking and resuming synchronously"
        )
        return SyncTransfers(copier)
    log.info("preemption: parking and resuming asynchronously through pinned host memory")
    return CudaTransfers(copier, kv)


def restores_from_cell(copier: object) -> bool:
    """Whether the runner's ``restore_cells`` takes ``first`` (write only a state's cells from
    ``first`` on): then a swap resume takes its pages still in the prefix cache by hash and copies
    back only the rest. The built-in runners do; a custom runner may (docs/custom-runners.md)."""
    restore = getattr(copier, "restore_cells", None)
    if restore is None:
        return False
    try:
        return "first" in inspect.signature(restore).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
