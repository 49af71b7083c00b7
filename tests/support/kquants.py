"""GGUF K-quant bytes (Q3_K, Q4_K, Q5_K, Q6_K) for tests: the ``gguf`` package dequantises
K-quants but cannot quantise them, and no K-quant file ships offline.

``quantize`` is a plain reference quantiser written from the format (min/max sub-block scales,
nearest quants; llama.cpp's search for better scales is left out, its Q6_K scale convention kept:
signed scales, the super-block's largest one at -128; Q3_K's alike, at -32). ``random_kquant``
gives valid bytes of any content, with f16 super-block scales that are finite and include zeros,
subnormals and negatives. Byte layouts, per 256-weight super-block::

    Q4_K (144 B): d f16 | dmin f16 | scales 12 B (6-bit sc, m x 8) | qs 128 B
    Q5_K (176 B): d f16 | dmin f16 | scales 12 B | qh 32 B (bit g: sub-block g's 5th bit) | qs 128 B
    Q6_K (210 B): ql 128 B | qh 64 B | scales 16 x int8 (per 16 weights) | d f16
    Q3_K (110 B): hmask 32 B | qs 64 B | scales 12 B (6-bit, per 16 weights) | d f16

weight = d * sc_j * q - dmin * m_j (Q4_K, Q5_K; sub-blocks of 32), d * sc_j * (q - 32) (Q6_K;
sub-blocks of 16), d * (sc_j - 32) * (q - 4) (Q3_K; sub-blocks of 16, q of 3 bits).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256
Q3_K, Q4_K = GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K
Q5_K, Q6_K = GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K
KQUANTS = (Q3_K, Q4_K, Q5_K, Q6_K)
# the types whose one f16 super-block scale ``d`` is their last two bytes (no dmin)
D_LAST = (Q3_K, Q6_K)


def quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """x [out, in] (in a multiple of 256) -> uint8 [out, in / 256 * bytes per super-block]."""
    out, inp = x.shape
    assert inp % QK_K == 0, inp
    flat = x.astype(np.float32).reshape(-1, QK_K)
    if qtype in D_LAST:
        packed = _q6_k(flat) if qtype == Q6_K else _q3_k(flat)
    else:
        packed = _qx_k(flat, 31 if qtype == Q5_K else 15)
    return packed.reshape(out, -1)


def random_kquant(qtype: GGMLQuantizationType, out: int, inp: int, seed: int) -> np.ndarray:
    """Random valid bytes of ``qtype`` for an [out, in] matrix: uint8 [out, in / 256 * size]."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[qtype][1]
    n = out * inp // QK_K
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    halves = 1 if qtype in D_LAST else 2  # d, and dmin for Q4_K / Q5_K
    scales = rng.standard_normal((n, halves)) * 0.01
    scales[rng.random((n, halves)) < 0.05] = 0.0
    scales[rng.random((n, halves)) < 0.05] *= 1e-3  # f16 subnormals
    at = size - 2 if qtype in D_LAST else 0
    raw[:, at : at + 2 * halves] = scales.astype(np.float16).view(np.uint8).reshape(n, -1)
    return raw.reshape(out, -1)


def quantised_kquant(qtype: GGMLQuantizationType, out: int, inp: int, seed: int) -> np.ndarray:
    """``random_kquant``'s signature and shape, but the bytes ``quantize`` makes of Gaussian
    weights (std 0.1, as tiny_gguf.py's other matrices): a model's magnitudes, where random
    bytes give weights up to ~40 (a Q6_K scale of 0.01 times ±128 times ±32)."""
    x = np.random.default_rng(seed).standard_normal((out, inp)).astype(np.float32) * 0.1
    return quantize(x, qtype)


def _qx_k(x: np.ndarray, nmax: int) -> np.ndarray:
    """Q4_K (nmax 15) or Q5_K (31) of super-blocks x [n, 256]."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)  # the offset is -dmin * m <= 0
    step = (sub.max(-1) - low) / nmax
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = ((-low).max(-1) / 63).astype(np.float16)
    sc = _nearest(step, d.astype(np.float32)[:, None], 63)
    m = _nearest(-low, dmin.astype(np.float32)[:, None], 63)
    scale = d.astype(np.float32)[:, None] * sc
    shift = dmin.astype(np.float32)[:, None] * m
    q = _nearest(sub + shift[..., None], scale[..., None], nmax)  # [n, 8, 32]
    scales = np.concatenate(
        [
            sc[:, :4] | (sc[:, 4:] >> 4) << 6,
            m[:, :4] | (m[:, 4:] >> 4) << 6,
            (sc[:, 4:] & 0x0F) | (m[:, 4:] & 0x0F) << 4,
        ],
        axis=1,
    )
    qs = (q[:, 0::2] & 0x0F) | (q[:, 1::2] & 0x0F) << 4  # [n, 4, 32]: sub-blocks 2g, 2g + 1
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales]
    if nmax == 31:
        bits = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
        parts.append(bits.sum(axis=1, dtype=np.uint8))  # [n, 32]
    return np.concatenate([*parts, qs.reshape(n, 128)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K of super-blocks x [n, 256]."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    # per 16 weights: the element of largest magnitude maps to -32, then a least-squares refit
    big = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    s = -big / 32
    lv = np.clip(np.rint(_div(sub, s[..., None])), -32, 31)
    w = sub * sub
    s = np.where((w * lv * lv).sum(-1) > 0, _div((w * sub * lv).sum(-1), (w * lv * lv).sum(-1)), s)
    top = np.take_along_axis(s, np.abs(s).argmax(-1)[:, None], -1)  # [n, 1]
    iscale = _div(np.full_like(top, -128.0), top)
    d = _div(np.ones_like(iscale), iscale).astype(np.float16)
    sc = np.clip(np.rint(iscale * s), -128, 127).astype(np.int8)  # [n, 16]
    scale = d.astype(np.float32) * sc
    q = np.clip(np.rint(_div(sub, scale[..., None])), -32, 31)
    q = (q + 32).astype(np.uint8).reshape(n, 2, 128)  # two halves of 128 weights
    ql = (q[:, :, :64] & 0x0F) | (q[:, :, 64:] & 0x0F) << 4  # [n, 2, 64]
    quarters = (q >> 4).reshape(n, 2, 4, 32) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    qh = quarters.sum(axis=2, dtype=np.uint8)  # [n, 2, 32]
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)],
        axis=1,
    )


def _q3_k(x: np.ndarray) -> np.ndarray:
    """Q3_K of super-blocks x [n, 256]: per 16 weights the element of largest magnitude maps to
    -4, the super-block's largest sub-scale to -32."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    big = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    s = -big / 4
    top = np.take_along_axis(s, np.abs(s).argmax(-1)[:, None], -1)  # [n, 1]
    iscale = _div(np.full_like(top, -32.0), top)
    d = _div(np.ones_like(iscale), iscale).astype(np.float16)
    sc = np.clip(np.rint(iscale * s), -32, 31).astype(np.int8)  # [n, 16]
    scale = d.astype(np.float32) * sc
    q = np.clip(np.rint(_div(sub, scale[..., None])), -4, 3).astype(np.int8) + 4  # 0..7
    q = q.astype(np.uint8).reshape(n, 256)
    low = (q & 3).reshape(n, 2, 4, 32) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    qs = low.sum(axis=2, dtype=np.uint8)  # [n, 2, 32]: byte l of half h
    hbits = (q >> 2).reshape(n, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]
    hmask = hbits.sum(axis=1, dtype=np.uint8)  # [n, 32]
    sc6 = (sc + 32).astype(np.uint8)
    low_nibbles = (sc6[:, :8] & 0x0F) | (sc6[:, 8:] & 0x0F) << 4
    top_bits = (sc6 >> 4).reshape(n, 4, 4) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    packed = np.concatenate([low_nibbles, top_bits.sum(axis=1, dtype=np.uint8)], axis=1)
    return np.concatenate(
        [hmask, qs.reshape(n, 64), packed, d.view(np.uint8).reshape(n, 2)], axis=1
    )


def _nearest(value: np.ndarray, step: np.ndarray, top: int) -> np.ndarray:
    """round(value / step) clipped to 0..top as uint8 (0 where step is 0)."""
    return np.clip(np.rint(_div(value, step)), 0, top).astype(np.uint8)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, broadcast, with 0 where b is 0."""
    shape = np.broadcast_shapes(a.shape, b.shape)
    return np.divide(a, b, out=np.zeros(shape, np.result_type(a, b)), where=b != 0)


def q6_k_one_scale_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For Q6_K bytes, per 32-weight block (two sub-blocks of 16): whether its two scales are
    equal, and whether it has an exact int8 form with one scale (bool [blocks] each).

    A block's weights are d * p_i with integers p_i = sc * (q_i - 32). One scale s and int8 v_i
    with s * v_i = d * p_i need s = d * G with G dividing every p_i; the largest such G, the gcd
    of the p_i, gives the smallest |v_i|, so the block has an exact form iff p_i / gcd fit int8.
    """
    b = raw.reshape(-1, GGML_QUANT_SIZES[Q6_K][1])
    n = b.shape[0]
    ql, qh = b[:, :128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.int64)  # [n, 16]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, 2, 128]
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(n, 2, 128)
    q = (low | high << 4).astype(np.int64).reshape(n, 16, 16) - 32
    p = (q * sc[..., None]).reshape(n * 8, 32)
    gcd = np.gcd.reduce(np.abs(p), axis=1)
    v = p // np.maximum(gcd, 1)[:, None]
    pairs = sc.reshape(n * 8, 2)
    return pairs[:, 0] == pairs[:, 1], (v.min(axis=1) >= -128) & (v.max(axis=1) <= 127)
