"""Q5_0 and Q5_1 matrices as int8 blocks (model/q5_blocks.py): bit for bit the values ``gguf``
itself dequantises, for rows quantised by ``gguf``'s own quantiser and for every byte pattern a
block can hold; a shape or type that is not theirs is refused."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from kvpark.model.q5_blocks import Q5_BLOCK_BYTES, q5_blocks


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1])
def test_quantised_rows_dequantise_as_gguf_reads_them(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3.0, (48, 1))).astype(np.float32)
    raw = quants.quantize(x, qtype)
    blocks = q5_blocks(int(qtype), raw.reshape(-1), (48, 96))
    assert blocks.kind == "q8" and blocks.shape == (48, 96)
    assert (blocks.offset is None) == (qtype == Q.Q5_0)
    theirs = quants.dequantize(raw, qtype).reshape(48, 96)
    assert blocks.dequantize().tobytes() == theirs.tobytes()


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1])
def test_every_byte_pattern_dequantises_as_gguf_reads_it(qtype: Q) -> None:
    """Random bytes for qh and the nibbles (every fifth bit and nibble pattern), finite scales."""
    rng = np.random.default_rng(7)
    n, size = 256, Q5_BLOCK_BYTES[int(qtype)]
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    halves = 2 if qtype == Q.Q5_0 else 4  # d (and m): finite f16 values of either sign
    raw[:, :halves] = (
        rng.uniform(-2.0, 2.0, (n, halves // 2)).astype(np.float16).view(np.uint8).reshape(n, -1)
    )
    blocks = q5_blocks(int(qtype), raw.reshape(-1), (8, 32 * n // 8))
    theirs = quants.dequantize(raw.reshape(8, -1), qtype).reshape(8, -1)
    assert blocks.dequantize().tobytes() == theirs.tobytes()
    q = blocks.qs.astype(np.int16)
    low, high = (-16, 15) if qtype == Q.Q5_0 else (0, 31)
    assert q.min() == low and q.max() == high  # every fifth bit and nibble was seen


def test_what_is_not_q5_is_refused() -> None:
    with pytest.raises(ValueError, match="not Q5_0 or Q5_1"):
        q5_blocks(int(Q.Q8_0), np.zeros(34, dtype=np.uint8), (1, 32))
    with pytest.raises(ValueError, match="blocks of 32"):
        q5_blocks(int(Q.Q5_0), np.zeros(22, dtype=np.uint8), (2, 16))
