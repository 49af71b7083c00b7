"""GGUF's K-quant matrices (Q3_K, Q4_K, Q5_K, Q6_K) repacked into the ``Blocks`` the Rust kernels
take, in numpy (the lean CPU runner and the torch model read them alike): integer and byte work
plus exact scale products, never the tensor dequantised to float32.

A K-quant super-block holds 256 weights: an f16 ``d`` and ``dmin``, then eight 32-weight
sub-blocks, each with a 6-bit scale ``sc`` and 6-bit min ``m`` (12 bytes for the 16), and the
quants. A sub-block's weight is ``(d * sc) * q - (dmin * m)``, which is a 32-block of ours with

    scale  = d * sc        exact in float32: an 11-bit f16 significand times 6 bits
    offset = -(dmin * m)   exact likewise

and ``scale * q`` is exact too (4 or 5 more bits, at most 22 in all), so the kernels' one rounding
``fma(scale, q, offset)`` and ``scale * q + offset`` are both the single rounding of
``gguf.quants``' ``(d * sc) * q - dmin * m``: bitwise the file's dequantised weights.

Q4_K -> kind "q4". The file's 4-bit layout differs from ours::

    Q4_K: 128 bytes per super-block = 4 groups of 32 bytes; byte l of group g holds
          weight l of sub-block 2g (low nibble) and weight l of sub-block 2g + 1 (high nibble)
    ours: 16 bytes per 32-block; byte i holds weight i (low nibble) and weight i + 16 (high)

Q5_K -> kind "q8" with an offset: int8 q = 0..31, the fifth bit from ``qh`` (bit g of byte l is
weight l of sub-block g).

Q6_K -> kind "q6": int8 q - 32 (in -32..31) and a float32 scale ``d * sc`` per 16 weights (an
11-bit f16 significand times an 8-bit int: exact, and ``scale * (q - 32)`` is too, at most 23
bits), so the kernels' one product is ``gguf.quants``' ``(d * sc) * (q - 32)``, bit for bit. Its
scales are per 16 weights, so no 32-block of ours with one scale holds it exactly
(docs/cpu-kernels.md); the bits in the file, per 256-weight super-block::

    ql 128 B: half h (0, 1) of 128 weights is 64 bytes; byte l holds weight 128h + l (low
              nibble) and 128h + 64 + l (high nibble), the quant's bits 0-3
    qh  64 B: half h is 32 bytes; bits 2j, 2j + 1 of byte l are bits 4-5 of weight 128h + 32j + l
    scales 16 x int8, one per 16 weights in order; d f16 (the last 2 bytes)

Q3_K -> kind "q6" as well: its weight is ``(d * (sc - 32)) * q`` with a 6-bit ``sc`` per 16
weights and ``q`` in -4..3, so the int8 quants are ``q`` and the scale ``d * (sc - 32)`` (exact:
11 bits times 6, and times ``q`` 3 more), bitwise ``gguf.quants``' product. Per super-block::

    hmask 32 B: bit b of byte l is weight 32b + l's high bit; q = low - 4 where it is 0
    qs    64 B: half h is 32 bytes; bits 2s, 2s + 1 of byte l are weight 128h + 32s + l's low bits
    scales 12 B: scale j's low nibble is nibble j // 8 of byte j % 8, its high two bits are bits
               2 (j // 4), +1 of byte 8 + j % 4
    d f16 (the last 2 bytes)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvpark.model.gguf_blocks import BLOCK, Q6_GROUP, Blocks, half_at

QK_K = 256  # weights per super-block
SUB_BLOCKS = QK_K // BLOCK
# GGML type ids (gguf.GGMLQuantizationType) of the K-quants kept as blocks, and their sizes
Q3_K, Q4_K, Q5_K, Q6_K = 11, 12, 13, 14
KQUANT_TYPES = (Q3_K, Q4_K, Q5_K, Q6_K)
SUPER_BLOCK_BYTES = {Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210}
_SCALES_AT, _SCALES_END = 4, 16  # the 12 bytes of packed 6-bit scales and mins

U8 = npt.NDArray[np.uint8]


def kquant_blocks(qtype: int, raw: U8, shape: tuple[int, int]) -> Blocks:
    """A Q3_K, Q4_K, Q5_K or Q6_K tensor's bytes (uint8, super-blocks in file order; may be a
    read-only view of the file) and its shape ``[out, in]`` as fresh ``Blocks``, bitwise
    ``gguf.quants.dequantize`` once dequantised."""
    out, inp = shape
    if qtype not in KQUANT_TYPES:
        raise ValueError(f"GGML type {qtype} is not a K-quant kept as blocks")
    if inp % QK_K:
        raise ValueError(f"a {shape} matrix does not split into super-blocks of {QK_K}")
    n = out * inp // QK_K
    blocks = raw.reshape(n, SUPER_BLOCK_BYTES[qtype])
    if qtype == Q6_K:
        return _q6_k_blocks(blocks, shape)
    if qtype == Q3_K:
        return _q3_k_blocks(blocks, shape)
    sc, m = scales_and_mins(blocks[:, _SCALES_AT:_SCALES_END])  # [n, 8] each
    scale = (half_at(blocks, 0) * sc.astype(np.float32)).reshape(out, -1)  # exact products
    offset = (-(half_at(blocks, 2) * m.astype(np.float32))).reshape(out, -1)
    low = _low_nibbles(blocks[:, -QK_K // 2 :])  # [n * 8, 32] uint8, weight order
    if qtype == Q4_K:
        qs = (low[:, : BLOCK // 2] | (low[:, BLOCK // 2 :] << 4)).reshape(out, inp // 2)
        return Blocks("q4", qs, scale, offset)
    qh = blocks[:, _SCALES_END : _SCALES_END + BLOCK]  # [n, 32]: bit g -> sub-block g
    bits = np.arange(SUB_BLOCKS, dtype=np.uint8).reshape(1, -1, 1)
    high = ((qh[:, None, :] >> bits) & 1).reshape(-1, BLOCK)  # [n * 8, 32]
    q = (low | (high << 4)).view(np.int8).reshape(out, inp)  # 0..31 fits int8
    return Blocks("q8", q, scale, offset)


def _q6_k_blocks(blocks: U8, shape: tuple[int, int]) -> Blocks:
    """Q6_K super-blocks (uint8 [n, 210]) as "q6" ``Blocks`` of ``shape`` (the layout above)."""
    out, inp = shape
    n = blocks.shape[0]
    ql = blocks[:, : QK_K // 2].reshape(n, 2, 1, QK_K // 4)
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F  # [n, 2, 2, 64]
    qh = blocks[:, QK_K // 2 : 3 * QK_K // 4].reshape(n, 2, 1, BLOCK)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & 0x03  # [n, 2, 4, 32]
    q = (low.reshape(n, QK_K) | (high.reshape(n, QK_K) << 4)).view(np.int8) - np.int8(32)
    sc = blocks[:, 3 * QK_K // 4 : 3 * QK_K // 4 + QK_K // Q6_GROUP].view(np.int8)  # [n, 16]
    scale = half_at(blocks, SUPER_BLOCK_BYTES[Q6_K] - 2) * sc.astype(np.float32)  # exact products
    return Blocks("q6", q.reshape(out, inp), scale.reshape(out, inp // Q6_GROUP), None)


def _q3_k_blocks(blocks: U8, shape: tuple[int, int]) -> Blocks:
    """Q3_K super-blocks (uint8 [n, 110]) as "q6" ``Blocks`` of ``shape`` (the layout above)."""
    out, inp = shape
    n = blocks.shape[0]
    qs = blocks[:, QK_K // 8 : 3 * QK_K // 8].reshape(n, 2, 1, BLOCK)
    two_bits = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    low = ((qs >> two_bits) & 0x03).reshape(n, QK_K)  # weight 128h + 32s + l
    hmask = blocks[:, : QK_K // 8].reshape(n, 1, BLOCK)
    high = (hmask >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # weight 32b + l
    q = low.view(np.int8) - ((high.reshape(n, QK_K) ^ 1) << 2).view(np.int8)  # -4..3
    packed = blocks[:, 3 * QK_K // 8 : 3 * QK_K // 8 + 12]
    nibble = (packed[:, None, :8] >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 0x0F
    top = (packed[:, None, 8:] >> two_bits.reshape(1, 4, 1)) & 0x03  # [n, 4, 4]
    sc = (nibble.reshape(n, 16) | (top.reshape(n, 16) << 4)).view(np.int8) - np.int8(32)
    scale = half_at(blocks, SUPER_BLOCK_BYTES[Q3_K] - 2) * sc.astype(np.float32)  # exact products
    return Blocks("q6", q.reshape(out, inp), scale.reshape(out, inp // Q6_GROUP), None)


def scales_and_mins(packed: U8) -> tuple[U8, U8]:
    """The 12 packed bytes of every super-block (uint8 [n, 12]) as its 8 6-bit scales and 8 6-bit
    mins (uint8 [n, 8] each). Bytes 0-3 hold scales 0-3 in their low 6 bits, 4-7 mins 0-3; the
    top 2 bits of those bytes are bits 4-5 of scales / mins 4-7, whose bits 0-3 are the nibbles
    of bytes 8-11 (scale low, min high)::

        byte 0-3  hhSSSSSS   S: scale j,  hh: scale j + 4 >> 4
        byte 4-7  hhMMMMMM   M: min j,    hh: min j + 4 >> 4
        byte 8-11 mmmmssss   s: scale j + 4 & 15,  m: min j + 4 & 15
    """
    sc_lo, m_lo, tail = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc_hi = (tail & 0x0F) | ((sc_lo >> 2) & 0x30)
    m_hi = (tail >> 4) | ((m_lo >> 2) & 0x30)
    sc = np.concatenate((sc_lo & 0x3F, sc_hi), axis=1)
    return sc, np.concatenate((m_lo & 0x3F, m_hi), axis=1)


def _low_nibbles(qs: U8) -> U8:
    """Q4_K / Q5_K's 128 bytes of 4-bit quants per super-block (uint8 [n, 128]) as [n * 8, 32]:
    one row per sub-block, weights in order."""
    groups = qs.reshape(-1, SUB_BLOCKS // 2, 1, BLOCK)  # [n, 4, 1, 32]
    shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return np.asarray(((groups >> shifts) & 0x0F).reshape(-1, BLOCK), dtype=np.uint8)
