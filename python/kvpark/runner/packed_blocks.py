"""The lean runner's q4 and q6 matrices packed once, when it builds its decoder, into the layout
its side-by-side kernel reads without transposing (``Blocks`` kinds "q4p" and "q6p"; the Rust
crate's ``packed`` module defines the layout).

Why: at several rows (chats decoding together, prompt chunks) AVX-512 VNNI's kernel multiplies
sixteen columns at once from vectors holding four weights of each column, and from the file's
row layout every product transposed each group's blocks first, every step. Packed, the same
bytes and values lie in that order already, and one row takes that kernel too (on a
Llama-1B-shaped Q4_K_M: eight chats +26 %, one +11 %). Only there: AVX2's kernels would read it
no faster, and its one-row kernel not at all (a matrix packed anyway is unpacked a group at a
time for them: same bits, slower). A matrix whose rows (its output columns) are not a multiple
of 16 stays as it is. ``KVPARK_CPU_PACK=off`` keeps every matrix in the file's layout (same
bits: for measuring).
"""

from __future__ import annotations

import os

import kvpark._core as _core
from kvpark.config.env import parse_bool, raw
from kvpark.model.gguf_blocks import PACK, Blocks
from kvpark.model.weight_arrays import Matrix, NumpyWeights, Stacked


def packing_on() -> bool:
    """Whether the lean runner packs its q4 and q6 matrices: where the int8 kernel it runs is
    AVX-512 VNNI's (under ``KVPARK_CPU_ISA``), the one that reads the packed layout, unless
    ``KVPARK_CPU_PACK=off`` (or one of the switches that turns that kernel off)."""
    wanted = parse_bool(raw("KVPARK_CPU_PACK"))
    switched_off = any(
        os.environ.get(v) == "off" for v in ("KVPARK_CPU_WIDE", "KVPARK_CPU_SIDE_BY_SIDE")
    )
    isa = _core._cpu_features()[1]
    return wanted and not switched_off and isa["isa"] == "avx512" and bool(isa["avx512_vnni"])


def pack_weights(w: NumpyWeights) -> None:
    """Every packable q4 and q6 matrix of ``w`` replaced by its packed form, in place and one at a
    time, so no more than one matrix is held twice while it runs (peak memory)."""
    for layer in w.layers:
        for name in list(layer.matrices):
            layer.matrices[name] = packed(layer.matrices[name])
    tied = w.head is w.embed
    w.embed = packed(w.embed)
    w.head = w.embed if tied else packed(w.head)


def packed(m: Matrix) -> Matrix:
    """``m`` packed where it is a "q4" or "q6" matrix of a multiple of ``PACK`` rows (a fused
    one part by part), else ``m``."""
    if isinstance(m, Stacked):
        return Stacked(tuple(p if not isinstance(p, Blocks) else _one(p) for p in m.parts))
    return _one(m) if isinstance(m, Blocks) else m


def _one(m: Blocks) -> Blocks:
    return m.packed() if m.kind in ("q4", "q6") and m.shape[0] % PACK == 0 else m
