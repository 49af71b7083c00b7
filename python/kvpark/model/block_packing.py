"""Block matrices packed for the CPU decoder's side-by-side kernels, and back: the arrays of the
``Blocks`` kinds "q4p", "q6p", "q5p" and "q5b" (the Rust crate's ``packed``, ``packed_q5`` and
``packed_q5_blocks`` modules document the bytes; the packing itself runs there, the unpacking,
for the readers that want the row layout, here in numpy).

Per group of ``PACK`` rows, blocks lie lane by lane of the int8 combine (``pack_position``),
each block its operand vectors. "q4p" holds a "q4" matrix's own bytes and values in that order;
"q6p" and "q5p" are compact, as their K-quant files held them: six (Q6_K, Q3_K) or five (Q5_K)
bits a quant with int8 scales (and offsets) per block, and an f32 ``d`` (and ``dmin``) per row
and 256 weights, where the loader's row layout takes a byte a quant and f32 values. "q5b"
(Q5_0's and Q5_1's "q8") is five bits a quant, stored less ``Q5B_LOW`` (-16 without offsets,
0 with), beside the row layout's f32 scale (and offset) a block in "q4p"'s order: their f16
scales are no K-quant's int8s times a ``d``.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import numpy.typing as npt

import kvpark._core as _core

BLOCK = 32
PACK = 16  # rows per group of a packed matrix (kvpark_cpu_ops::PACK)
SUPER = 8  # blocks of a compact row that share one d (and dmin): a K-quant super-block
Q6P_ROW_BYTES = 26  # a "q6p" row's block: 32 six-bit quants and two int8 scales
Q5P_ROW_BYTES = 22  # a "q5p" row's block: 32 five-bit quants, an int8 scale and offset
ROW_BYTES = {"q6p": Q6P_ROW_BYTES, "q5p": Q5P_ROW_BYTES}
Q5B_ROW_BYTES = 20  # a "q5b" row's block: 32 five-bit quants
# what a "q5b" matrix's quants are stored less: Q5_0's (no offsets) are in -16..16, Q5_1's in 0..32
Q5B_LOW = {False: -16, True: 0}  # keyed by whether it has offsets

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
Arrays = tuple[npt.NDArray[np.uint8] | npt.NDArray[np.int8], F32, F32 | None]


def pack_position(blocks: int) -> npt.NDArray[np.intp]:
    """Where each of a row's ``blocks`` blocks lies in a packed group: lane by lane of the int8
    combine (blocks l, l + 8, l + 16, ... for lane l = 0..8), the order the kernels walk."""
    order = np.concatenate([np.arange(lane, blocks, 8) for lane in range(8)])
    at = np.empty(blocks, np.intp)
    at[order] = np.arange(blocks)
    return at


def packed_arrays(kind: str, arrays: Arrays, out: int, inp: int) -> tuple[str, Arrays]:
    """A "q4", "q6" or "q8" matrix's arrays, its shape ``[out, inp]`` (``out`` a multiple of
    ``PACK``), packed into fresh ones, and their kind: "q4p", "q6p", or for "q8" "q5p" where
    its scales and offsets are a K-quant's (Q5_K's) else "q5b" where its quants span the five
    bits of Q5_0's or Q5_1's; ValueError (from the packer) for a q6 one no K-quant gave or a q8
    one of neither (Q8_0's)."""
    if kind == "q8":
        if arrays[2] is not None:
            try:
                return "q5p", _packed("q8", arrays, out, inp)
            except ValueError:
                pass  # a Q5_1's f16 scales: its blocks' own values, below
        return "q5b", _packed_q5b(arrays, out, inp)
    return kind + "p", _packed(kind, arrays, out, inp)


def _packed_q5b(arrays: Arrays, out: int, inp: int) -> Arrays:
    """A "q8" matrix whose quants lie in ``Q5B_LOW``'s window packed as "q5b"; ValueError for
    one whose do not."""
    qs, scale, offset = arrays
    low = Q5B_LOW[offset is not None]
    q = np.ascontiguousarray(qs).view(np.int8)
    if q.size and (int(q.min()) < low or int(q.max()) >= low + 32):
        raise ValueError(f"packs q8 quants in {low}..{low + 32} only (Q5_0's, Q5_1's)")
    src: list[npt.NDArray[np.generic]] = [q, np.ascontiguousarray(scale)]
    if offset is not None:
        src.append(np.ascontiguousarray(offset))
    dst_qs = np.empty((out, inp // BLOCK * Q5B_ROW_BYTES), np.uint8)
    values = [np.empty((out, inp // BLOCK), np.float32) for _ in src[1:]]
    a = [int(x.ctypes.data) for x in src] + [0]
    b = [int(dst_qs.ctypes.data)] + [int(v.ctypes.data) for v in values] + [0]
    _core._cpu_pack_q5_blocks(a[0], a[1], a[2], out, inp, low, b[0], b[1], b[2])
    return dst_qs, values[0], values[1] if len(values) > 1 else None


def _packed(kind: str, arrays: Arrays, out: int, inp: int) -> Arrays:
    """``packed_arrays`` for "q4", "q6" and Q5_K's "q8"."""
    qs, scale, offset = arrays
    src = [np.ascontiguousarray(a) for a in (qs, scale, offset) if a is not None]
    blocks = inp // BLOCK
    dst: list[npt.NDArray[np.generic]]
    if kind == "q4":
        dst = [np.empty_like(a) for a in src]
    else:
        row_bytes = Q6P_ROW_BYTES if kind == "q6" else Q5P_ROW_BYTES
        supers = -(-blocks // SUPER)
        dst = [np.empty((out, blocks * row_bytes), np.uint8)]
        dst += [np.empty((out, supers), np.float32) for _ in src[1:]]
    a, b = [int(x.ctypes.data) for x in src], [int(x.ctypes.data) for x in dst]
    if kind == "q4":
        _core._cpu_pack_q4(a[0], a[1], a[2], out, inp, b[0], b[1], b[2])
    elif kind == "q6":
        _core._cpu_pack_q6(a[0], a[1], out, inp, b[0], b[1])
    else:
        if offset is None:
            raise ValueError("packs q8 blocks with offsets (Q5_K's) only")
        _core._cpu_pack_q5(a[0], a[1], a[2], out, inp, b[0], b[1], b[2])
    packed_qs = cast("npt.NDArray[np.uint8]", dst[0])
    values = [cast(F32, v) for v in dst[1:]]
    return packed_qs, values[0], values[1] if len(values) > 1 else None


def unpacked_arrays(kind: str, arrays: Arrays, out: int, inp: int) -> Arrays:
    """A "q4p", "q6p", "q5p" or "q5b" matrix's arrays back in the row layout of the "q4", "q6"
    or "q8" one it packs: each group's blocks from their positions back to [row, block]."""
    qs, scale, offset = arrays
    groups, blocks = out // PACK, inp // BLOCK
    at = pack_position(blocks)
    if kind == "q5b":
        b = qs.reshape(groups, blocks, Q5B_ROW_BYTES * PACK)[:, at]
        u = _five_bits(b.view(np.uint8), groups, blocks) + np.int8(Q5B_LOW[offset is not None])
        rows = np.ascontiguousarray(u.transpose(0, 3, 1, 2, 4)).reshape(out, inp)
        back = None if offset is None else _values(offset, groups, blocks, at)
        return rows, _values(scale, groups, blocks, at), back
    if kind == "q4p":
        quads = qs.reshape(groups, blocks, 4, PACK, 4)[:, at].transpose(0, 3, 1, 2, 4)
        assert offset is not None
        rows = cast("npt.NDArray[np.uint8]", np.ascontiguousarray(quads)).reshape(out, -1)
        return rows, _values(scale, groups, blocks, at), _values(offset, groups, blocks, at)
    b = qs.reshape(groups, blocks, ROW_BYTES[kind] * PACK)[:, at]  # [group, block, byte]
    low = b[..., :256].reshape(groups, blocks, 4, PACK, 4)  # [.., j, row, e]
    t = np.arange(8)
    nib = (low[:, :, t % 4] >> (4 * (t // 4)).astype(np.uint8)[:, None, None]) & 15
    if kind == "q6p":
        top = b[..., 256:384].reshape(groups, blocks, 2, PACK, 4)
        high = (top[:, :, t % 2] >> (2 * (t // 2)).astype(np.uint8)[:, None, None]) & 3
        u = (nib | (high << 4)).view(np.int8) - np.int8(32)  # [group, block, t, row, e]
        ints = b[..., 384:416].view(np.int8).reshape(groups, blocks, 2, PACK)
        per = [_per_block(scale, groups, blocks)] * 2
    else:
        u = _five_bits(b.view(np.uint8), groups, blocks)  # 0..32
        ints = b[..., 320:352].view(np.int8).reshape(groups, blocks, 2, PACK)
        assert offset is not None
        per = [_per_block(scale, groups, blocks), _per_block(offset, groups, blocks)]
    rows = np.ascontiguousarray(u.transpose(0, 3, 1, 2, 4)).reshape(out, inp)
    # each value d * int8 (or dmin * int8): exact products, the loader's values
    ints = ints.transpose(0, 3, 1, 2).astype(np.float32)  # [group, row, block, value]
    values = [(p * ints[..., v]).reshape(out, blocks) for v, p in enumerate(per)]
    if kind == "q6p":  # two scales a block, in order
        both = np.stack(values, axis=-1).reshape(out, 2 * blocks)
        return rows, np.ascontiguousarray(both), None
    return rows, values[0], values[1]


def _five_bits(b: npt.NDArray[np.uint8], groups: int, blocks: int) -> npt.NDArray[np.int8]:
    """The five-bit quants of packed blocks ``b`` [group, block, byte] (a "q5p" or "q5b"
    block's first 320 bytes) as int8 [group, block, quad, row, byte of the quad]."""
    low = b[..., :256].reshape(groups, blocks, 4, PACK, 4)  # [.., j, row, e]
    t = np.arange(8)
    nib = (low[:, :, t % 4] >> (4 * (t // 4)).astype(np.uint8)[:, None, None]) & 15
    top = b[..., 256:320].reshape(groups, blocks, 1, PACK, 4)
    high = (top >> t.astype(np.uint8)[:, None, None]) & 1
    return cast("npt.NDArray[np.int8]", (nib | (high << 4)).view(np.int8))


def _values(v: F32, groups: int, blocks: int, at: npt.NDArray[np.intp]) -> F32:
    """A "q4p" value array (a vector of the group's rows per block) back to [row, block]."""
    back = v.reshape(groups, blocks, PACK)[:, at].transpose(0, 2, 1)
    return np.ascontiguousarray(back).reshape(groups * PACK, blocks)


def _per_block(v: F32, groups: int, blocks: int) -> F32:
    """A compact matrix's per-256 values (each group's as [run of 256, row]) as [group, row,
    block]: each block's own."""
    per_run = v.reshape(groups, -1, PACK).transpose(0, 2, 1)  # [group, row, run]
    return np.repeat(per_run, SUPER, axis=2)[:, :, :blocks]
