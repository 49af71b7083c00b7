"""Copies of a parked sequence's cells between the KV pool and its slot's host buffer, and the
handle by which a copy in flight is known (its pieces: ``transfer.py``), and which way of copying
parking gets (``make_transfers``).

::

    save(cells, out)      pool cells ──► host buffer       a park's copy out
    restore(src, cells)   host buffer ──► fresh pool cells  a resume's copy back
    -> Transfer           done(): has it landed? (never blocks)   wait(): block until it has

``SyncTransfers`` copies through the runner at once (any device, any runner): its transfers have
landed when they are returned. ``CudaTransfers`` (preempt/cuda_copies.py) issues the copy on a
stream of its own and returns at once, so the decode goes on while the bytes move::

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
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvpark.preempt.sync_copies import SyncTransfers
from kvpark.preempt.transfer import CellCopier, Transfers
from kvpark.preempt.transfer import Transfer as Transfer  # named here by tests/support/preempt.py

if TYPE_CHECKING:
    from kvpark.model.ops.kv_cache import KVCache


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
    if not want_async or kv is None or _device_type(kv) != "cuda":
        return SyncTransfers(copier)
    from kvpark.preempt.cuda_copies import cuda_transfers  # torch: a CUDA pool has it loaded

    return cuda_transfers(copier, kv) or SyncTransfers(copier)


def _device_type(kv: object) -> str | None:
    """The device of a pool's first tensor, without importing torch (a numpy pool has none)."""
    try:
        return str(kv.k[0].device.type)  # type: ignore[attr-defined]
    except (AttributeError, IndexError, TypeError):
        return None


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
