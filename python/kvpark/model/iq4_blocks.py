"""GGUF's IQ4_NL and IQ4_XS matrices as the ``Blocks`` of kind "iq4" the Rust kernels take, in
numpy, losslessly: both are 4-bit indices into one fixed table of sixteen int8 values, so a
weight is a scale times an int8: the q8 kind's product, which the kernels compute from the
nibbles, looked up in registers (docs/cpu-kernels.md).

    IQ4_NL: 18 bytes per 32 weights = d (f16), 16 bytes of nibbles
            weight j = d * TABLE[nibble j]
    IQ4_XS: 136 bytes per 256 weights = d (f16), scales_h (u16: 2 bits per 32), scales_l
            (4 bytes: 4 bits per 32), 128 bytes of nibbles (16 per 32)
            weight j of sub-block s = (d * (scale_s - 32)) * TABLE[nibble j]

The nibbles of a 32-weight (sub-)block are in our order (byte j: weight j low, weight j + 16
high), so "iq4" keeps them as they are: ``qs`` the nibbles, ``scale`` ``d`` (IQ4_NL) or
``d * (scale_s - 32)`` (IQ4_XS; exact in float32: an 11-bit significand times a 6-bit integer),
no offset. The kernels' one product ``scale * TABLE[nibble]`` is then ``gguf.quants``' one
product: bitwise the file's dequantised weights. Each weight takes 4 bits and a scale per 32
(4.125 bits a weight in memory against the file's 4.25 or 4.5).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvpark.model.gguf_blocks import BLOCK, IQ4_TABLE, Blocks, half_at

# GGML type ids (gguf.GGMLQuantizationType) and block sizes in bytes
IQ4_NL, IQ4_XS = 20, 23
IQ4_TYPES = (IQ4_NL, IQ4_XS)
SUPER = 256  # weights per IQ4_XS block
TABLE = IQ4_TABLE  # the values a nibble indexes

U8 = npt.NDArray[np.uint8]


def iq4_blocks(qtype: int, raw: U8, shape: tuple[int, int]) -> Blocks:
    """An IQ4_NL or IQ4_XS tensor's bytes (uint8, blocks in file order; may be a read-only view
    of the file) and its shape ``[out, in]`` as fresh "iq4" ``Blocks``, bitwise
    ``gguf.quants.dequantize`` once dequantised."""
    out, inp = shape
    if qtype not in IQ4_TYPES:
        raise ValueError(f"GGML type {qtype} is not IQ4_NL or IQ4_XS")
    per = BLOCK if qtype == IQ4_NL else SUPER
    if inp % per:
        raise ValueError(f"a {shape} matrix does not split into blocks of {per}")
    if qtype == IQ4_NL:
        blocks = raw.reshape(out * inp // BLOCK, 18)
        scale = half_at(blocks, 0).reshape(out, -1)
        nibbles = blocks[:, 2:]  # [blocks, 16]
    else:
        blocks = raw.reshape(out * inp // SUPER, 136)
        d = half_at(blocks, 0)  # [n, 1]
        high = blocks[:, 2:4].copy().view("<u2")  # [n, 1]: 2 bits per sub-block
        high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, 8]
        low = blocks[:, 4:8]  # [n, 4]: 4 bits per sub-block, two per byte
        low = np.stack((low & 0x0F, low >> 4), axis=-1).reshape(-1, 8)  # [n, 8]
        sub = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
        scale = (d * sub.astype(np.float32)).reshape(out, -1)
        nibbles = blocks[:, 8:].reshape(-1, BLOCK // 2)  # [sub-blocks, 16]
    qs = np.ascontiguousarray(nibbles).reshape(out, inp // 2)
    return Blocks("iq4", qs, scale.astype(np.float32), None)
