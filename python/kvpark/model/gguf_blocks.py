"""A GGUF matrix's 32-weight blocks as numpy arrays: the byte layout read in one place.

GGUF stores Q4_0, Q4_1 and Q8_0 matrices as blocks of 32 weights: an f16 scale (and for Q4_1 an
f16 offset), then the quants; 4-bit quants hold weight i of a block in the low nibble of byte i
and weight i + 16 in the high nibble. ``Blocks`` splits them into the arrays the Rust kernels
take (scales widened to float32, Q4_0's offset made explicit as -8 * scale: exact, a power-of-two
multiple). GGUF's K-quants are repacked into these kinds (model/kquant_repack.py), Q6_K into a
kind of its own, "q6": int8 quants with a scale per 16 weights, and IQ4_NL / IQ4_XS into "iq4":
nibbles indexing ``IQ4_TABLE`` (model/iq4_blocks.py). numpy, not torch: the CPU server
builds its decoder without torch (lean_runner.py); ``BlockWeight.from_blocks`` wraps these arrays
for the torch model, without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpark.model.block_packing import (
    PACK,
    ROW_BYTES,
    packed_arrays,
    unpacked_arrays,
)

BLOCK = 32
Q6_GROUP = 16  # weights per scale of kind "q6"
# the values an "iq4" nibble indexes (llama.cpp's kvalues_iq4nl, as the GGUF format defines them)
IQ4_TABLE = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8
)
# GGML type ids (gguf.GGMLQuantizationType) of the block formats kept as blocks
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_TYPES = (Q4_0, Q4_1, Q8_0)
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}


# each packed kind and the kind it packs (a "q8" matrix packs as "q5p" or "q5b")
PACKED = {"q4p": "q4", "q6p": "q6", "q5p": "q8", "q5b": "q8"}


@dataclass(frozen=True)
class Blocks:
    """A matrix ``[out, in]`` in blocks of 32 along ``in`` (BlockWeight's layout, in numpy).

    ``kind`` "q4": ``qs`` [out, in / 2] uint8; weight = scale * nibble + offset.
    ``kind`` "q8": ``qs`` [out, in] int8; weight = scale * q (+ offset where given).
    ``scale`` and ``offset``: [out, in / 32] float32.
    ``kind`` "q6" (Q6_K): ``qs`` [out, in] int8 (the file's q - 32); ``scale`` [out, in / 16]
    float32, one per 16 weights; no offset; weight = scale * q.
    ``kind`` "iq4" (IQ4_NL, IQ4_XS): ``qs`` [out, in / 2] uint8 in q4's nibble order; no offset;
    weight = scale * IQ4_TABLE[nibble]: the "q8" blocks of ``as_q8`` at half their bytes.
    ``kind`` "q4p": a "q4" matrix of a multiple of ``PACK`` rows packed for the CPU decoder's
    side-by-side kernels (``packed``; the Rust crate's ``packed`` module has the layout): the
    same arrays' shapes and values in another order.
    ``kind`` "q6p": a "q6" matrix packed so, compact as its K-quant file held it: ``qs`` [out,
    in * 13 / 16] uint8 (six bits a quant and an int8 scale per 16 weights, a block's 26 bytes
    a row), ``scale`` [out, ceil(in / 256)] float32 (one ``d`` per row and 256 weights, each
    group's as [run of 256, row]: each scale is ``d * sc``, exact), no offset.
    ``kind`` "q5p": a Q5_K's "q8" matrix (quants 0..32, offsets) packed so: ``qs`` [out, in *
    11 / 16] uint8 (five bits a quant, an int8 scale and offset per block: 22 bytes a row),
    ``scale`` and ``offset`` its ``d`` and ``dmin`` as "q6p"'s ``d``.
    ``kind`` "q5b": a Q5_0's or Q5_1's "q8" matrix (quants in -16..16 without offsets, 0..32
    with them) packed so: ``qs`` [out, in * 5 / 8] uint8 (five bits a quant, the quant less -16
    or 0: 20 bytes a block a row), ``scale`` and ``offset`` as "q4p"'s. (model/block_packing.py)
    Rows of ``PACK`` stay together in all of them, so ``cat`` holds as it is; ``rows`` and
    ``dequantize`` read them ``unpacked``.
    """

    kind: str
    qs: npt.NDArray[np.uint8] | npt.NDArray[np.int8]
    scale: npt.NDArray[np.float32]
    offset: npt.NDArray[np.float32] | None

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind in ROW_BYTES:  # compact: the quants' bytes say the shape
            return self.qs.shape[0], self.qs.shape[1] * BLOCK // ROW_BYTES[self.kind]
        return self.scale.shape[0], self.scale.shape[1] * scale_group(self.kind)

    @property
    def nbytes(self) -> int:
        offset = 0 if self.offset is None else self.offset.nbytes
        return self.qs.nbytes + self.scale.nbytes + offset

    def rows(self, index: npt.NDArray[np.int64]) -> Blocks:
        """The matrix with its rows reordered (or selected) by ``index``."""
        if self.kind in PACKED:
            return self.unpacked().rows(index)
        offset = None if self.offset is None else self.offset[index]
        return Blocks(self.kind, self.qs[index], self.scale[index], offset)

    def as_q8(self) -> Blocks:
        """An "iq4" matrix as the "q8" blocks it equals (``q = IQ4_TABLE[nibble]``)."""
        assert self.kind == "iq4"
        out, inp = self.shape
        q = nibbles(self.qs.reshape(-1, BLOCK // 2).view(np.uint8), np.intp)
        return Blocks("q8", IQ4_TABLE[q].reshape(out, inp), self.scale, None)

    def dequantize(self) -> npt.NDArray[np.float32]:
        """The float32 matrix: ``BlockWeight.dequantize``'s arithmetic, bit for bit."""
        if self.kind == "iq4":
            return self.as_q8().dequantize()
        if self.kind in PACKED:
            return self.unpacked().dequantize()
        out, inp = self.shape
        scale = self.scale.reshape(-1, 1)
        if self.kind in ("q8", "q6"):  # q6: one scale per row of 16, the kernels' one product
            q = self.qs.reshape(-1, scale_group(self.kind)).astype(np.float32)
            if self.offset is None:
                return (q * scale).reshape(out, inp)
        else:
            q = nibbles(self.qs.reshape(-1, BLOCK // 2).view(np.uint8))
        assert self.offset is not None
        return (scale * q + self.offset.reshape(-1, 1)).reshape(out, inp)

    def packed(self) -> Blocks:
        """A "q4", "q6" or "q8" matrix of a multiple of ``PACK`` rows as "q4p", "q6p", or
        "q5p" (Q5_K's) or "q5b" (Q5_0's, Q5_1's), in fresh arrays; ValueError for another kind,
        a q6 one no K-quant gave, or a q8 one of neither (Q8_0's: model/block_packing.py)."""
        out, inp = self.shape
        if self.kind not in ("q4", "q6", "q8") or out % PACK:
            raise ValueError(
                f"packs q4, q6 and q8 matrices of a multiple of {PACK} rows, not {self.kind} "
                f"{self.shape}"
            )
        kind, (qs, scale, offset) = packed_arrays(
            self.kind, (self.qs, self.scale, self.offset), out, inp
        )
        return Blocks(kind, qs, scale, offset)

    def unpacked(self) -> Blocks:
        """A "q4p", "q6p", "q5p" or "q5b" matrix as the "q4", "q6" or "q8" one it packs, bit
        for bit."""
        assert self.kind in PACKED
        out, inp = self.shape
        arrays = unpacked_arrays(self.kind, (self.qs, self.scale, self.offset), out, inp)
        return Blocks(PACKED[self.kind], *arrays)

    @staticmethod
    def cat(parts: list[Blocks]) -> Blocks:
        """Rows of several matrices of one kind, in order (a fused Q/K/V or gate/up matrix);
        q8 parts without offsets beside parts with get -0.0 (BlockWeight.cat says why). The one
        fusing code: the torch model's BlockWeight.cat runs it on numpy views."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse block matrices of kinds {sorted(kinds)}")
        if kinds == {"q5b"} and len({p.offset is None for p in parts}) > 1:
            # a "q5b" part's quants are stored less -16 or 0 by whether it has offsets: a Q5_0
            # part beside a Q5_1 one fuses in the row layout
            return Blocks.cat([p.unpacked() for p in parts])
        offset = None
        if any(p.offset is not None for p in parts):
            offset = np.concatenate(
                [p.offset if p.offset is not None else np.full_like(p.scale, -0.0) for p in parts]
            )
        return Blocks(
            parts[0].kind,
            np.concatenate([p.qs for p in parts]),
            np.concatenate([p.scale for p in parts]),
            offset,
        )


def scale_group(kind: str) -> int:
    """Weights per scale (and offset) of a block kind."""
    return Q6_GROUP if kind in ("q6", "q6p") else BLOCK


def blocks_from_gguf(qtype: int, raw: npt.NDArray[np.uint8], shape: tuple[int, int]) -> Blocks:
    """A GGUF tensor's bytes (uint8, blocks in file order) as ``Blocks`` of ``shape`` [out, in];
    every array is a fresh copy (``raw`` may be a read-only view of the file)."""
    out, inp = shape
    if inp % BLOCK:
        raise ValueError(f"a {shape} matrix does not split into blocks of {BLOCK}")
    size = BLOCK_BYTES[qtype]
    blocks = raw.reshape(out * inp // BLOCK, size)
    scale = half_at(blocks, 0).reshape(out, -1)
    if qtype == Q8_0:
        return Blocks("q8", blocks[:, 2:].copy().view(np.int8).reshape(out, inp), scale, None)
    offset = half_at(blocks, 2).reshape(out, -1) if qtype == Q4_1 else np.float32(-8.0) * scale
    qs = blocks[:, size - BLOCK // 2 :].copy().reshape(out, inp // 2)
    return Blocks("q4", qs, scale, offset)


def half_at(blocks: npt.NDArray[np.uint8], at: int) -> npt.NDArray[np.float32]:
    """The f16 at byte ``at`` of every block (uint8 [n, size]), as float32 [n, 1]."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def nibbles(qs: npt.NDArray[np.uint8], dtype: type[np.generic] = np.float32) -> npt.NDArray[Any]:
    """4-bit quants (uint8 [n, 16]) as ``dtype`` [n, 32], in weight order."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=1).astype(dtype)


def unpermute_rows(rows: int, n_heads: int) -> npt.NDArray[np.int64]:
    """The row order that undoes llama.cpp's Q/K permutation for its interleaved rope: GGUF rows
    2i, 2i+1 of a head are Hugging Face rows i, i + d/2 (gguf_tensors.py applies it)."""
    index = np.arange(rows, dtype=np.int64).reshape(n_heads, rows // n_heads // 2, 2)
    return index.transpose(0, 2, 1).reshape(-1)
