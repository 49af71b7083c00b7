"""GGUF's Q5_0 and Q5_1 matrices as the int8 ``Blocks`` (kind "q8") the Rust kernels take, in
numpy, losslessly. llama-quantize writes them where a K-quant does not fit a row (a row of 576
weights is not a multiple of a K-quant's 256: SmolLM2's Q4_K_M file is mostly Q5_0, its Q5_K_M
mostly Q5_1), so a ``_M`` file of a small model runs on the decoder only if these do.

Both are 32-weight blocks with an f16 ``d``, a 32-bit ``qh`` (bit j: the fifth bit of weight j)
and 16 bytes of nibbles (byte j: weight j low, weight j + 16 high), our own nibble order::

    Q5_0: 22 bytes = d, qh, qs          weight = d * (q - 16)
    Q5_1: 24 bytes = d, m, qh, qs       weight = d * q + m

As "q8" blocks: ``qs`` the int8 ``q - 16`` (Q5_0) or ``q`` (Q5_1), ``scale`` = d, ``offset`` =
m (Q5_1 only). ``d * q`` is exact in float32 (11 significant bits times 5 or 6), so the kernels'
one rounding of ``scale * q + offset`` is ``gguf.quants``' rounding of ``d * q + m``: bitwise the
file's dequantised weights. Each weight takes a byte instead of 5.5 or 6 bits: the cost of
running them on the q8 kernels rather than kernels of their own (docs/cpu-kernels.md).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvpark.model.gguf_blocks import BLOCK, Blocks, half_at

# GGML type ids (gguf.GGMLQuantizationType) and block sizes in bytes
Q5_0, Q5_1 = 6, 7
Q5_TYPES = (Q5_0, Q5_1)
Q5_BLOCK_BYTES = {Q5_0: 22, Q5_1: 24}

U8 = npt.NDArray[np.uint8]


def q5_blocks(qtype: int, raw: U8, shape: tuple[int, int]) -> Blocks:
    """A Q5_0 or Q5_1 tensor's bytes (uint8, blocks in file order; may be a read-only view of
    the file) and its shape ``[out, in]`` as fresh "q8" ``Blocks``, bitwise
    ``gguf.quants.dequantize`` once dequantised."""
    out, inp = shape
    if qtype not in Q5_TYPES:
        raise ValueError(f"GGML type {qtype} is not Q5_0 or Q5_1")
    if inp % BLOCK:
        raise ValueError(f"a {shape} matrix does not split into blocks of {BLOCK}")
    size = Q5_BLOCK_BYTES[qtype]
    blocks = raw.reshape(out * inp // BLOCK, size)
    scale = half_at(blocks, 0).reshape(out, -1)
    high_at = 2 if qtype == Q5_0 else 4  # Q5_1 has its f16 m before qh
    qh = blocks[:, high_at : high_at + 4].copy().view("<u4")  # [n, 1]
    fifth = ((qh >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, 32]
    low = blocks[:, size - BLOCK // 2 :]
    q = np.concatenate((low & 0x0F, low >> 4), axis=1) | (fifth << 4)  # 0..31, weight order
    if qtype == Q5_0:
        qs = (q.astype(np.int16) - 16).astype(np.int8).reshape(out, inp)
        return Blocks("q8", qs, scale, None)
    offset = half_at(blocks, 2).reshape(out, -1)
    return Blocks("q8", q.astype(np.int8).reshape(out, inp), scale, offset)
