"""IQ4_NL and IQ4_XS matrices as "iq4" blocks (model/iq4_blocks.py): their nibbles and scales, and
the "q8" blocks they equal, bit for bit the values ``gguf`` itself dequantises, for every byte
pattern a block can hold; a shape or type that is not theirs is refused."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from kvpark.model.iq4_blocks import TABLE, iq4_blocks

BYTES = {Q.IQ4_NL: (32, 18), Q.IQ4_XS: (256, 136)}


@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.IQ4_XS])
def test_every_byte_pattern_dequantises_as_gguf_reads_it(qtype: Q) -> None:
    """Random bytes for the nibbles and IQ4_XS's scale bits, finite f16 super-scales."""
    rng = np.random.default_rng(int(qtype))
    per, size = BYTES[qtype]
    n = 64
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    raw[:, :2] = rng.uniform(-2.0, 2.0, (n, 1)).astype(np.float16).view(np.uint8).reshape(n, 2)
    shape = (8, per * n // 8)
    blocks = iq4_blocks(int(qtype), raw.reshape(-1), shape)
    assert blocks.kind == "iq4" and blocks.shape == shape and blocks.offset is None
    assert blocks.qs.shape == (8, shape[1] // 2) and blocks.qs.flags.c_contiguous
    theirs = quants.dequantize(raw.reshape(8, -1), qtype).reshape(shape)
    assert blocks.dequantize().tobytes() == theirs.tobytes()
    q8 = blocks.as_q8()
    assert q8.kind == "q8" and q8.dequantize().tobytes() == theirs.tobytes()
    assert set(np.unique(q8.qs)) == set(TABLE.tolist())  # every nibble was seen


def test_iq4_xs_scales_cover_their_six_bits() -> None:
    """Each sub-block scale is ``d * (s - 32)`` for s = 0..63: the low and high bits both read."""
    rng = np.random.default_rng(3)
    n = 64
    raw = rng.integers(0, 256, (n, 136), dtype=np.uint8)
    raw[:, :2] = np.array([1.0], np.float16).view(np.uint8)  # d = 1: the scales are integers
    blocks = iq4_blocks(int(Q.IQ4_XS), raw.reshape(-1), (1, 256 * n))
    seen = set(blocks.scale.reshape(-1).astype(int).tolist())
    assert seen == set(range(-32, 32))


def test_what_is_not_iq4_is_refused() -> None:
    with pytest.raises(ValueError, match="not IQ4_NL or IQ4_XS"):
        iq4_blocks(int(Q.Q8_0), np.zeros(34, dtype=np.uint8), (1, 32))
    with pytest.raises(ValueError, match="blocks of 256"):
        iq4_blocks(int(Q.IQ4_XS), np.zeros(136, dtype=np.uint8), (2, 128))
