"""IQ4_NL and IQ4_XS bytes from float weights, for the tests' GGUFs (the ``gguf`` package cannot
quantise either): each weight the table value nearest its share of a block scale, the format's
layout byte for byte (model/iq4_blocks.py reads it). Not llama.cpp's search for the best scale:
any valid bytes serve a test whose reference is the file's own dequantised weights."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


def _nibbles(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The table index nearest each ``x / step`` (x [n, 32], step [n, 1]), as the 16 bytes of
    each row: weight j in the low nibble of byte j, weight j + 16 in its high nibble."""
    ratio = np.divide(x, step, out=np.zeros_like(x), where=step != 0)
    q = np.abs(ratio[..., None] - TABLE).argmin(-1).astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def quantize_iq4(x: np.ndarray, qtype: Q) -> np.ndarray:
    """``x`` [out, in] float32 as IQ4_NL or IQ4_XS bytes, uint8 [out, in / block * size]."""
    out = x.shape[0]
    if qtype == Q.IQ4_NL:
        blocks = x.reshape(-1, 32)
        d = (np.abs(blocks).max(-1, keepdims=True) / 127).astype(np.float16)
        raw = np.concatenate([d.view(np.uint8), _nibbles(blocks, d.astype(np.float32))], axis=1)
        return raw.reshape(out, -1)
    if qtype != Q.IQ4_XS:
        raise ValueError(f"{qtype.name} is not IQ4_NL or IQ4_XS")
    sub = x.reshape(-1, 8, 32)  # super-blocks of eight 32-weight sub-blocks
    want = np.abs(sub).max(-1) / 127  # [n, 8]: each sub-block's step
    d = (want.max(-1, keepdims=True) / 31).astype(np.float16)  # (ls - 32) reaches 31
    d32 = d.astype(np.float32)
    ls = np.clip(np.rint(np.divide(want, d32, out=np.zeros_like(want), where=d32 != 0)), 0, 31)
    ls = (ls + 32).astype(np.uint16)  # 32..63: non-negative sub-block scales
    step = (d32 * (ls.astype(np.float32) - 32)).reshape(-1, 1)
    nib = _nibbles(sub.reshape(-1, 32), step).reshape(-1, 8 * 16)
    low = (ls & 0x0F).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)  # [n, 4]
    high = ((ls >> 4) & 3) << (2 * np.arange(8, dtype=np.uint16))
    scales_h = high.sum(-1, dtype=np.uint16).reshape(-1, 1)
    raw = np.concatenate([d.view(np.uint8), scales_h.view(np.uint8), scales_l, nib], axis=1)
    return raw.reshape(out, -1)
