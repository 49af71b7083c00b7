"""The lean runner's q4, q6, Q5_K, Q5_0 and Q5_1 matrices packed as each is read, into the layout
its side-by-side kernels read without transposing (``Blocks`` kinds "q4p", "q6p", "q5p" and
"q5b"; model/block_packing.py, and the Rust crate's ``packed``, ``packed_q5`` and
``packed_q5_blocks`` modules, define it).

Why: at several rows (chats decoding together) the side-by-side kernels multiply sixteen
(AVX-512 VNNI) or eight (AVX2) columns at once from vectors holding four weights of each
column, and from the file's row layout every product transposed each group's blocks first,
every step. Packed, the blocks lie in that order already, the kernels read them in place, and
one row takes them too (on a Llama-1B-shaped Q4_K_M, AVX-512: eight chats +26 %, one +11 %;
AVX2: eight chats +13-17 %, one +3 % for q4 alone). q6 (Q6_K, Q3_K) and Q5_K's q8 blocks pack
compact, six or five bits a quant with int8 scales (and offsets) as their files held them,
where the loader's row layout takes a byte a quant and f32 values (10 bits a weight against
the file's 6.5 or 5.5: peak memory and a memory-bound single stream pay for each); Q5_0's and
Q5_1's (SmolLM2's Q4_K_M and Q5_K_M files are mostly those) five bits a quant beside an f32
scale (and offset) a block, 6 or 7 bits a weight where the row layout takes 9 or 10. A q6
matrix whose values no K-quant gave, and a q8 one of full range (Q8_0's), stay as they are.
A kernel that
cannot read a packed matrix gets it unpacked a group at a time (same bits, slower), so only
the kinds this CPU's kernels read are packed (``packed_kinds``). A matrix whose rows (its output
columns) are not a multiple of 16 stays as it is. ``KVPARK_CPU_PACK=off`` keeps every matrix in
the loader's layout (same bits: for measuring).
"""

from __future__ import annotations

import os

import kvpark._core as _core
from kvpark.config.env import parse_bool, raw
from kvpark.model.block_packing import PACK
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.weight_arrays import Matrix, NumpyWeights, Stacked


def packed_kinds() -> frozenset[str]:
    """The block kinds the lean runner packs on this CPU (under ``KVPARK_CPU_ISA``): "q4",
    "q6" and "q8" (Q5_K's, Q5_0's, Q5_1's) wherever an int8 kernel reads them in place (AVX-512
    VNNI:
    ``wide_packed.rs``; AVX2: ``side_by_side_packed.rs`` and ``wide_avx2_packed.rs``), none on
    the portable kernel; none with ``KVPARK_CPU_PACK=off`` or ``KVPARK_CPU_SIDE_BY_SIDE=off``,
    "q4" alone with ``KVPARK_CPU_WIDE=off`` (the kernels that read the others turned off)."""
    if not parse_bool(raw("KVPARK_CPU_PACK")) or os.environ.get("KVPARK_CPU_SIDE_BY_SIDE") == "off":
        return frozenset()
    isa = _core._cpu_features()[1]
    if isa["isa"] == "plain":
        return frozenset()
    if os.environ.get("KVPARK_CPU_WIDE") == "off":
        return frozenset({"q4"})
    return frozenset({"q4", "q6", "q8"})


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
        # a q6 matrix no K-quant gave, or a q8 one of the full range (Q8_0's), cannot be
        # packed compact: it keeps the row layout, which every kernel reads
        if m.kind == "q4":
            raise
        return m
