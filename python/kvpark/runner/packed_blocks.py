"""The lean runner's q4 and q6 matrices packed once, when it builds its decoder, into the layout
its side-by-side kernel reads without transposing (``Blocks`` kinds "q4p" and "q6p"; the Rust
crate's ``packed`` module defines the layout).

Why: at several rows (chats decoding together) the side-by-side kernels multiply sixteen
(AVX-512 VNNI) or eight (AVX2) columns at once from vectors holding four weights of each
column, and from the file's row layout every product transposed each group's blocks first,
every step. Packed, the same bytes and values lie in that order already, the kernels read them
in place, and one row takes them too (on a Llama-1B-shaped Q4_K_M, AVX-512: eight chats +26 %,
one +11 %; AVX2: eight chats +13-17 %, one +3 % for q4 alone). A kernel that cannot read a packed
matrix gets it unpacked a group at a time (same bits, slower), so only the kinds this CPU's
kernels read are packed (``packed_kinds``). A matrix whose rows (its output columns) are not a
multiple of 16 stays as it is. A q6 matrix packs compact, six bits a quant and an int8 scale per
16 weights as its Q6_K or Q3_K file held them (the row layout takes 10 bits a weight: peak memory
and a memory-bound single stream pay for each); one whose values no K-quant gave stays as it is.
``KVPARK_CPU_PACK=off`` keeps every matrix in the file's layout (same bits: for measuring).
"""

from __future__ import annotations

import os

import kvpark._core as _core
from kvpark.config.env import parse_bool, raw
from kvpark.model.gguf_blocks import PACK, Blocks
from kvpark.model.weight_arrays import Matrix, NumpyWeights, Stacked


def packed_kinds() -> frozenset[str]:
    """The block kinds the lean runner packs on this CPU (under ``KVPARK_CPU_ISA``): "q4" and
    "q6" wherever an int8 kernel reads them in place (AVX-512 VNNI: ``wide_packed.rs``; AVX2:
    ``side_by_side_packed.rs`` and ``wide_avx2_packed.rs``), none on the portable kernel; none
    with ``KVPARK_CPU_PACK=off`` or ``KVPARK_CPU_SIDE_BY_SIDE=off``, "q4" alone with
    ``KVPARK_CPU_WIDE=off`` (the kernels that read q6 turned off)."""
    if not parse_bool(raw("KVPARK_CPU_PACK")) or os.environ.get("KVPARK_CPU_SIDE_BY_SIDE") == "off":
        return frozenset()
    isa = _core._cpu_features()[1]
    if isa["isa"] == "plain":
        return frozenset()
    if os.environ.get("KVPARK_CPU_WIDE") == "off":
        return frozenset({"q4"})
    return frozenset({"q4", "q6"})


def pack_weights(w: NumpyWeights, kinds: frozenset[str]) -> None:
    """Every matrix of ``w`` of one of ``kinds`` and a multiple of ``PACK`` rows replaced by its
    packed form, in place and one at a time, so no more than one matrix is held twice while it
    runs (peak memory)."""
    for layer in w.layers:
        for name in list(layer.matrices):
            layer.matrices[name] = packed(layer.matrices[name], kinds)
    tied = w.head is w.embed
    w.embed = packed(w.embed, kinds)
    w.head = w.embed if tied else packed(w.head, kinds)


def packed(m: Matrix, kinds: frozenset[str]) -> Matrix:
    """``m`` packed where it is of one of ``kinds`` and a multiple of ``PACK`` rows (a fused
    one part by part), else ``m``."""
    if isinstance(m, Stacked):
        return Stacked(
            tuple(packed_blocks(p, kinds) if isinstance(p, Blocks) else p for p in m.parts)
        )
    return packed_blocks(m, kinds) if isinstance(m, Blocks) else m


def packed_blocks(m: Blocks, kinds: frozenset[str]) -> Blocks:
    """One block matrix ``m`` packed where it is of one of ``kinds`` and a multiple of ``PACK``
    rows, else ``m``."""
    if m.kind not in kinds or m.shape[0] % PACK:
        return m
    try:
        return m.packed()
    except ValueError:
        # a q6 matrix no K-quant gave (quants outside -32..32, scales not d times int8s)
        # cannot be packed compact: it keeps the row layout, which every kernel reads
        if m.kind != "q6":
            raise
        return m
