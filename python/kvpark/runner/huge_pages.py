"""The lean runner's matrices moved into one anonymous mapping that asks the kernel for
transparent huge pages (``madvise(MADV_HUGEPAGE)``), each at a 64-byte boundary.

Why: a decode step streams every weight from memory once, and through 4 KiB pages its
prefetches and loads cross a page every 4 KiB, each a TLB miss and a page walk of its own. numpy
asks for huge pages too, but only for an array of 4 MiB or more, and only the whole 2 MiB runs
inside it get them: of the default model's F32 file, some 40 % of the weights' bytes (the tied
embedding and most of each gate/up matrix). In one mapping nearly every byte is on a huge page.
On an Intel Xeon VM (2 cores, 2 threads): an F32 product against a 3072 x 576 matrix streamed
from memory 260 -> 237 µs at one row and 320 -> 293 µs at eight; the F32 file served, single
stream +4 % and eight chats +2 % (alternated against ``off``); F16 and Q8_0 steps in process
+1-5 %.

The bits do not change (the same values, elsewhere). Each matrix is moved in turn and its old
array freed (and the heap's freed pages handed back), so a load's peak holds one matrix twice:
the largest, the F32 file's 113 MB embedding. The kernel may compact memory to find huge pages
the first time (~1 s for the 514 MB F32 file here); where it gives none (transparent huge pages
``never``, or none to be had) the mapping is plain memory. ``KVPARK_HUGE_PAGES=off`` keeps
numpy's arrays.
"""

from __future__ import annotations

import mmap
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvpark.config.env import Knobs
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.sources import return_freed_heap
from kvpark.model.weight_arrays import Matrix, NumpyWeights, Single, Stacked

T = TypeVar("T", bound=np.generic)
HUGE_PAGE = 2 * 2**20
ALIGN = 64  # a cache line: no load of a matrix's first row straddles two


class Arena:
    """One private anonymous mapping of ``nbytes`` (and a huge page's alignment), advised for
    huge pages; :meth:`take` copies arrays into it one after another."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(
            -1,
            nbytes + HUGE_PAGE,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        self._bytes = np.frombuffer(self._map, np.uint8)  # its arrays keep the mapping alive
        self._next = -int(self._bytes.ctypes.data) % HUGE_PAGE  # the first huge-page boundary
        self.advised = False
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        length = (len(self._map) - self._next) // HUGE_PAGE * HUGE_PAGE
        if advice is not None and length:
            try:
                self._map.madvise(advice, self._next, length)
                self.advised = True
            except OSError:  # a kernel built without transparent huge pages
                pass

    @property
    def start(self) -> int:
        """The mapping's address."""
        return int(self._bytes.ctypes.data)

    def take(self, a: npt.NDArray[T]) -> npt.NDArray[T]:
        """A C-contiguous copy of ``a`` in the mapping."""
        first = -(-self._next // ALIGN) * ALIGN
        if first + a.nbytes > self._bytes.size:
            raise ValueError(f"the arena has no room for {a.nbytes} more bytes")
        out = self._bytes[first : first + a.nbytes].view(a.dtype).reshape(a.shape)
        out[...] = a
        self._next = first + a.nbytes
        return out


def arena_bytes(w: NumpyWeights) -> int:
    """The bytes an arena needs for every matrix of ``w``, each at a 64-byte boundary."""
    arrays = [a for p in w.matrix_parts() for a in _arrays(p)]
    return sum(-(-int(a.nbytes) // ALIGN) * ALIGN for a in arrays)


def move_weights(w: NumpyWeights) -> Arena | None:
    """Every matrix of ``w`` moved into one arena, in place and one at a time; the arena, or
    None with ``KVPARK_HUGE_PAGES=off`` (nothing moved)."""
    if not Knobs.from_env().huge_pages:
        return None
    arena = Arena(arena_bytes(w))
    for layer in w.layers:
        for name in list(layer.matrices):
            layer.matrices[name] = _moved(layer.matrices[name], arena)
        return_freed_heap()  # glibc would keep the old arrays' heap pages resident
    tied = w.head is w.embed
    w.embed = _moved(w.embed, arena)
    w.head = w.embed if tied else _moved(w.head, arena)
    return_freed_heap()
    return arena


def _arrays(m: Single) -> list[npt.NDArray[Any]]:
    if isinstance(m, Blocks):
        return [m.qs, m.scale] + ([] if m.offset is None else [m.offset])
    return [m]


def _moved(m: Matrix, arena: Arena) -> Matrix:
    if isinstance(m, Stacked):
        return Stacked(tuple(_moved_one(p, arena) for p in m.parts))
    return _moved_one(m, arena)


def _moved_one(m: Single, arena: Arena) -> Single:
    if isinstance(m, Blocks):
        offset = None if m.offset is None else arena.take(m.offset)
        qs: npt.NDArray[Any] = arena.take(m.qs)  # uint8 or int8, as it was
        return replace(m, qs=qs, scale=arena.take(m.scale), offset=offset)
    return arena.take(m)
