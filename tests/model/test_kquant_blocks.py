"""K-quant matrices (Q3_K, Q4_K, Q5_K, Q6_K) repacked into block weights (model/kquant_repack.py, in
numpy), and why Q6_K needs a kind of its own (a scale per 16 weights).

The repacked weights must be bitwise ``gguf.quants.dequantize`` of the same bytes, for valid bytes
of any content and for bytes quantised from real weights; the products must match float64 within
float32 rounding and be row-invariant. The K-quant bytes come from tests/support/kquants.py (gguf
has no K-quant quantiser), which is itself checked here against gguf's dequantisers.

Q5_K goes through the q8 kernel with offsets, Q6_K and Q3_K through the q6 kind (``_blockmm_q6``:
int8 quants, a float32 scale per 16 weights), both dots of each.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kvpark.model.gguf_file import GgufFile
from kvpark.model.gguf_tensors import read_tensor
from kvpark.model.kquant_repack import kquant_blocks, scales_and_mins
from kvpark.model.ops import BlockWeight
from kvpark.model.ops.block_weights import block_linear
from support.kquants import (
    KQUANTS,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    q6_k_one_scale_blocks,
    quantize,
    random_kquant,
)

SHAPES = [(1, 256), (8, 512), (48, 768), (3, 1536)]
KEPT = {Q3_K: "q6", Q4_K: "q4", Q5_K: "q8", Q6_K: "q6"}
# quants, f32 scale, f32 offset; q6: int8 quants, two f32 scales, no offset
BYTES_PER_32 = {"q4": 16 + 4 + 4, "q8": 32 + 4 + 4, "q6": 32 + 2 * 4}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # equal bits, not equal values: -0.0 is not 0.0


def repack(qtype: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, int]) -> BlockWeight:
    return BlockWeight.from_blocks(kquant_blocks(int(qtype), raw.reshape(-1), shape))


def gguf_weights(
    qtype: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, int]
) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, qtype)).view(shape)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("source", ["random bytes", "quantised weights"])
def test_k_quants_repack_to_the_dequantised_weights_bitwise(
    qtype: GGMLQuantizationType, shape: tuple[int, int], source: str
) -> None:
    out, inp = shape
    if source == "random bytes":
        raw = random_kquant(qtype, out, inp, seed=out + inp)
    else:
        gen = np.random.default_rng(out)
        raw = quantize((gen.standard_normal(shape) * 0.05).astype(np.float32), qtype)
    w = repack(qtype, raw, shape)
    want = gguf_weights(qtype, raw, shape)
    assert w.kind == KEPT[qtype] and w.shape == shape and (w.offset is None) == (w.kind == "q6")
    assert torch.equal(bits(w.dequantize()), bits(want))
    assert np.array_equal(w.blocks().dequantize().view(np.int32), want.numpy().view(np.int32))
    assert w.nbytes == out * inp // 32 * BYTES_PER_32[w.kind]


def test_scales_and_mins_unpack_as_gguf_does() -> None:
    raw = random_kquant(Q4_K, 16, 1024, seed=2).reshape(-1, 144)[:, 4:16]
    want_sc, want_m = quants.Q4_K.get_scale_min(raw.copy())
    sc, m = scales_and_mins(raw)
    assert np.array_equal(sc, want_sc) and np.array_equal(m, want_m)
    assert sc.max() > 47 and m.max() > 47  # bits 4-5 of the upper four were exercised


# Relative RMS error of the helper's quantiser on Gaussian weights (measured: 0.15, 0.078, 0.038,
# 0.018): about what 3.4, 4.5, 5.5 and 6.6 bits give; a byte in the wrong place gives ~1.
RELATIVE_RMSE = {Q3_K: 0.18, Q4_K: 0.09, Q5_K: 0.045, Q6_K: 0.022}


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
def test_the_helper_quantiser_writes_k_quants_gguf_reads_back(qtype: GGMLQuantizationType) -> None:
    x = np.random.default_rng(7).standard_normal((32, 768)).astype(np.float32)
    back = quants.dequantize(quantize(x, qtype), qtype)
    error = np.sqrt(((back - x) ** 2).mean()) / x.std()
    assert 0 < error < RELATIVE_RMSE[qtype]


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [0, 1, 5, 17])
@pytest.mark.parametrize("int8", [False, True], ids=["float32 dot", "int8 dot"])
def test_k_quant_products_match_float64_and_each_row_stands_alone(
    qtype: GGMLQuantizationType, rows: int, int8: bool
) -> None:
    """The float32 dot within its bound of float64; the int8 dot's bound is the kernels'
    (rust/cpu_ops/tests/int8_bound.rs), here only each row's bits alone."""
    raw = random_kquant(qtype, 40, 512, seed=rows)
    w = replace(repack(qtype, raw, (40, 512)), int8=int8)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=gen)
    y = block_linear(x, w)
    dense = w.dequantize().double()
    # float32 sums of n terms, any order: within n * 2^-24 * sum|terms| of the exact sum
    bound = 512 * 2.0**-24 * (x.double().abs() @ dense.abs().T)
    assert y.shape == (rows, 40)
    assert int8 or bool(((y.double() - x.double() @ dense.T).abs() <= bound).all())
    for r in range(rows):
        assert torch.equal(block_linear(x[r : r + 1], w)[0], y[r])


def test_q8_parts_with_and_without_offsets_fuse_with_the_same_bits() -> None:
    # a Q8_0-like part with a negative scale: its zero quants are -0.0 weights, which a +0.0
    # offset would turn into +0.0
    qs = torch.randint(-3, 4, (4, 256), dtype=torch.int8)
    plain = BlockWeight("q8", qs, -torch.rand(4, 8) - 0.1, None)
    k5 = repack(Q5_K, random_kquant(Q5_K, 6, 256, seed=4), (6, 256))
    fused = BlockWeight.cat([plain, k5, plain])
    assert fused.kind == "q8" and fused.shape == (14, 256) and fused.offset is not None
    assert torch.equal(bits(fused.offset[:4]), bits(torch.full((4, 8), -0.0)))
    want = torch.cat([plain.dequantize(), k5.dequantize(), plain.dequantize()])
    assert torch.equal(bits(fused.dequantize()), bits(want))
    assert bool(torch.signbit(fused.dequantize()[:4][qs == 0]).all()) and bool((qs == 0).any())
    assert BlockWeight.cat([plain, plain]).offset is None  # Q8_0 alone keeps no offsets


def test_rows_of_an_offset_q8_matrix_keep_their_offsets() -> None:
    w = repack(Q5_K, random_kquant(Q5_K, 12, 512, seed=5), (12, 512))
    index = torch.tensor([11, 0, 5, 5, 3])
    assert torch.equal(bits(w.rows(index).dequantize()), bits(w.dequantize()[index]))


def test_bad_k_quant_inputs_are_refused() -> None:
    w = repack(Q5_K, random_kquant(Q5_K, 2, 256, seed=0), (2, 256))
    assert w.offset is not None
    with pytest.raises(ValueError, match="want"):
        BlockWeight("q8", w.qs, w.scale, w.offset[:, :-1].contiguous())
    with pytest.raises(ValueError, match="super-blocks of 256"):
        kquant_blocks(int(Q4_K), np.zeros(144, dtype=np.uint8), (2, 128))
    with pytest.raises(ValueError, match="not a K-quant"):
        kquant_blocks(int(GGMLQuantizationType.Q2_K), np.zeros(84, dtype=np.uint8), (1, 256))
    q6 = repack(Q6_K, random_kquant(Q6_K, 2, 256, seed=1), (2, 256))
    with pytest.raises(ValueError, match="no offsets"):
        BlockWeight("q6", q6.qs, q6.scale, q6.scale)
    with pytest.raises(ValueError, match="want"):
        BlockWeight("q6", q6.qs, q6.scale[:, ::2].contiguous(), None)  # a scale per 32


def test_q6_k_rows_and_fusing_keep_their_bits() -> None:
    w = repack(Q6_K, random_kquant(Q6_K, 12, 512, seed=6), (12, 512))
    index = torch.tensor([11, 0, 5, 5, 3])
    assert torch.equal(bits(w.rows(index).dequantize()), bits(w.dequantize()[index]))
    fused = BlockWeight.cat([w, w.rows(index)])
    assert fused.kind == "q6" and fused.shape == (17, 512) and fused.offset is None
    assert torch.equal(bits(fused.dequantize()[12:]), bits(w.dequantize()[index]))
    q4 = repack(Q4_K, random_kquant(Q4_K, 4, 512, seed=6), (4, 512))
    with pytest.raises(ValueError, match=r"kinds \['q4', 'q6'\]"):
        BlockWeight.cat([q4, w])  # one kernel kind per matrix


def test_q6_k_blocks_seldom_have_one_exact_scale(default_gguf_path: str) -> None:
    """Why Q6_K has a kind of its own (docs/cpu-kernels.md): its scales are per 16 weights, and
    a 32-block of q8 has one. On a real matrix (the default model's layer-7 ffn_down,
    dequantised, then quantised to Q6_K) few 32-blocks have an exact int8 form with one scale,
    and no row has it in every block, so no matrix could be kept as q8 blocks without changing
    weights."""
    g = GgufFile(default_gguf_path)
    weights = read_tensor(g, next(t for t in g.tensors if t.name == "blk.7.ffn_down.weight"))
    assert isinstance(weights, np.ndarray)
    equal, exact = q6_k_one_scale_blocks(quantize(weights, Q6_K))
    rows_exact = exact.reshape(weights.shape[0], -1).all(axis=1)
    print(f"\nQ6_K 32-blocks: equal scales {equal.mean():.1%}, one exact scale {exact.mean():.1%}")
    assert equal.mean() <= exact.mean() < 0.2 and not rows_exact.any()
    gaussian = np.random.default_rng(0).standard_normal((64, 1536)).astype(np.float32)
    equal, exact = q6_k_one_scale_blocks(quantize(gaussian, Q6_K))
    print(f"Gaussian: equal scales {equal.mean():.1%}, one exact scale {exact.mean():.1%}")
    assert equal.mean() <= exact.mean() < 0.1 and not exact.reshape(64, -1).all(axis=1).any()
