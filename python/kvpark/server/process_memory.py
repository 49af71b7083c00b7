"""Three habits of a long-lived server process that keep its resident memory what it uses.

- **Few malloc arenas.** glibc gives each thread that allocates an arena of its own, up to eight
  per core, and keeps what is freed in each. A server runs the engine thread, the event loop and
  a thread per request being parsed (Starlette's thread pool: 16 at 16 chats); over a 1 / 4 / 8 /
  16 chat sweep of the default model that grew the peak RSS by ~110 MB, against ~55 with two
  arenas. Python's small objects do not go through them (pymalloc), and the large buffers (the
  pool, the weights, the kernels' workspace) are allocated once, so sharing costs no speed
  measurable here. A ``MALLOC_ARENA_MAX`` set in the environment wins (glibc reads it itself).
- **No GPU libraries held on a CPU.** torch from PyPI is a CUDA build: importing it maps and
  touches cuBLASLt, nvJitLink, NVRTC, libtorch_cuda and the rest, ~140 MB of their pages resident
  in a process that never runs a GPU kernel. On a CPU-only server they are handed back to the
  page cache right after the import (:func:`release_gpu_libraries`).
- **Frozen loading.** See :func:`freeze_loaded_objects`.

These are Linux / glibc / CPython facts: elsewhere each is a no-op.
"""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

SERVER_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)
_MADV_PAGEOUT = 21  # madvise's advice number (Linux 5.4+, asm-generic/mman-common.h)
# the CUDA build's GPU libraries, by path: NVIDIA's wheels (nvidia/...) and torch's own CUDA parts
GPU_LIBRARIES = ("/nvidia/", "/libtorch_cuda", "/libc10_cuda", "/libcudart", "/libnccl")


def _glibc() -> ctypes.CDLL | None:
    """The C library, where it is glibc's ``libc.so.6``; None elsewhere."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def limit_malloc_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` unless ``MALLOC_ARENA_MAX`` is set; whether it
    did. Threads started before keep the arenas they have."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None)
    return mallopt is not None and mallopt(_M_ARENA_MAX, arenas) == 1


def release_gpu_libraries(maps: str = "/proc/self/maps") -> int:
    """Ask the kernel to reclaim every page of the GPU libraries mapped now (``MADV_PAGEOUT``);
    the mappings advised.

    Safe whatever the libraries hold: PAGEOUT reclaims a clean page (their code and read-only
    data, most of it) by dropping it, since the file has it, and leaves a page written at load
    (relocations) where it is, as nothing can take it without swap. A page used again is faulted
    back from the file. Only for a process that runs no GPU kernel: ``kvpark serve`` calls it when
    the model's device is the CPU (``KVPARK_RELEASE_GPU_LIBS=off`` keeps them).
    """
    libc = _glibc()
    try:
        lines = Path(maps).read_text().splitlines()
    except OSError:
        return 0  # not Linux
    if libc is None:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or not any(part in fields[5] for part in GPU_LIBRARIES):
            continue
        low, high = (int(end, 16) for end in fields[0].split("-"))
        if libc.madvise(low, high - low, _MADV_PAGEOUT) == 0:
            advised += 1
    return advised


def freeze_loaded_objects() -> None:
    """Move every object alive now out of the cyclic collector's reach (``gc.freeze``).

    Loading leaves ~1M objects that live as long as the server (torch's operator tables, the
    model's modules, the tokenizer's vocabulary). Python's oldest-generation collection walks
    all of them: 113 ms for the default model on a 2-core EPYC, with the GIL held, so every
    stream stalls that long whenever one runs. Frozen, they are never walked again; what serving
    creates is collected as before. Loading's garbage goes first, so that none of it is kept.
    Only in the server (``run.py`` calls it once the engine is ready): a process that builds and
    drops engines (tests, scripts using ``kvpark.LLM``) would keep the cycles of the dropped
    ones. ``KVPARK_GC_FREEZE=off`` skips it.
    """
    gc.collect()
    gc.freeze()
