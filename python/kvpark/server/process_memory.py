"""Two habits of a long-lived server process that keep its resident memory what it uses.

- **Few malloc arenas.** glibc gives each thread that allocates an arena of its own, up to eight
  per core, and keeps what is freed in each. A server runs the engine thread, the event loop and
  a thread per request being parsed (Starlette's thread pool: 16 at 16 chats); over a 1 / 4 / 8 /
  16 chat sweep of the default model that grew the peak RSS by ~110 MB, against ~55 with two
  arenas. Python's small objects do not go through them (pymalloc), and the large buffers (the
  pool, the weights, the kernels' workspace) are allocated once, so sharing costs no speed
  measurable here. A ``MALLOC_ARENA_MAX`` set in the environment wins (glibc reads it itself).
- **Frozen loading.** See :func:`freeze_loaded_objects`.

Both are glibc / CPython facts: elsewhere the first is a no-op.
"""

from __future__ import annotations

import ctypes
import gc
import os

SERVER_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


def limit_malloc_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` unless ``MALLOC_ARENA_MAX`` is set; whether it
    did. Threads started before keep the arenas they have."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False  # not glibc
    mallopt = getattr(libc, "mallopt", None)
    return mallopt is not None and mallopt(_M_ARENA_MAX, arenas) == 1


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
