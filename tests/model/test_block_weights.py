"""Block weights (``--weights blocks``): GGUF Q4_0 / Q4_1 / Q8_0 matrices kept in their blocks and
multiplied in Rust, and the other CPU kernels of ``rust/cpu_ops`` (decode attention, RMSNorm).

The weights must be bitwise the dequantised ones; the products must match float64 within
float32 rounding and be row-invariant; a model loaded with blocks must give the dense model's
greedy tokens (what does not depend on the machine) and logprobs within a relative bound, in
normal and exact mode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

import kvpark
from kvpark import SamplingParams
from kvpark.cli import main as cli
from kvpark.cli.flags import engine_config
from kvpark.model import load_model
from kvpark.model.ops import BlockWeight, block_weights, norm
from kvpark.model.ops.block_weights import block_linear
from kvpark.runner.torch_runner import resolve_weights

CPU = torch.device("cpu")
PROMPTS = [
    "Explain why the sky is blue, in three short sentences.",
    "Write a haiku about autumn leaves.",
    "def fibonacci(n):",
]
# Logprobs of the block model against the dense one: the weights are the same bits, only the order
# of the float32 sums differs (8 lanes in block order against MKL's), which moves a result by a
# few float32 ulps an op; a 1 % relative bound (plus 1e-4 for logprobs near 0) is orders of
# magnitude above that on any machine, and far below what a wrong weight or row would give.
LOGPROB_RELATIVE = 1e-2
LOGPROB_ABSOLUTE = 1e-4


def random_blocks(qtype: GGMLQuantizationType, out: int, inp: int, seed: int) -> np.ndarray:
    """Valid GGUF bytes: random quants with finite, modest f16 scales (and offsets)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (out * inp // block, size), dtype=np.uint8)
    halves = 2 if qtype == GGMLQuantizationType.Q4_1 else 1
    scales = (rng.standard_normal((raw.shape[0], halves)) * 0.05).astype(np.float16)
    raw[:, : 2 * halves] = scales.view(np.uint8).reshape(raw.shape[0], 2 * halves)
    return raw


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_hold_the_dequantised_weights_bitwise(qtype: str) -> None:
    t = GGMLQuantizationType[qtype]
    raw = random_blocks(t, 48, 96, seed=1)
    w = BlockWeight.from_gguf(int(t), torch.from_numpy(raw.reshape(-1).copy()), (48, 96))
    want = torch.from_numpy(quants.dequantize(raw.reshape(48, -1), t)).view(48, 96)
    assert torch.equal(w.dequantize(), want)  # the gguf package's own dequantisation
    assert w.shape == (48, 96) and w.nbytes < want.numel() * 4 / 3


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 17])
def test_the_product_matches_float64_and_each_row_stands_alone(kind: str, rows: int) -> None:
    t = GGMLQuantizationType[kind]
    raw = random_blocks(t, 200, 128, seed=rows)
    w = BlockWeight.from_gguf(int(t), torch.from_numpy(raw.reshape(-1).copy()), (200, 128))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=gen)
    bias = torch.randn(200, generator=gen)
    y = block_linear(x, w, bias)
    dense = w.dequantize().double()
    want = x.double() @ dense.T + bias.double()
    assert y.shape == (rows, 200) and y.dtype == torch.float32
    # Float32 sums of n terms in any order are within n * 2^-24 * sum|terms| of the exact sum (the
    # classic gamma_n bound); a fixed tolerance fails on an unlucky cancellation.
    magnitude = x.double().abs() @ dense.abs().T + bias.double().abs()
    bound = (128 + 1) * 2.0**-24 * magnitude
    assert bool(((y.double() - want).abs() <= bound).all())
    for r in range(rows):  # the same bits alone as beside the other rows
        assert torch.equal(block_linear(x[r : r + 1], w, bias)[0], y[r])


def test_bad_shapes_and_dtypes_are_refused() -> None:
    raw = random_blocks(GGMLQuantizationType.Q4_1, 8, 64, seed=0)
    w = BlockWeight.from_gguf(3, torch.from_numpy(raw.reshape(-1).copy()), (8, 64))
    with pytest.raises(ValueError, match="does not match"):
        block_linear(torch.zeros(2, 32), w)
    with pytest.raises(ValueError, match="float32"):
        block_linear(torch.zeros(2, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="want"):
        BlockWeight("q4", w.qs[:, :-1].contiguous(), w.scale, w.offset)
    with pytest.raises(ValueError, match="offsets"):
        BlockWeight("q4", w.qs, w.scale, None)
    with pytest.raises(ValueError, match="blocks of 32"):
        BlockWeight.from_gguf(3, torch.zeros(20, dtype=torch.uint8), (1, 20))


def test_the_default_model_loads_its_matrices_as_blocks() -> None:
    blocks = load_model(None, torch.float32, CPU, progress=False, blocks=True).model
    dense = load_model(None, torch.float32, CPU, progress=False).model
    for attr in ("qkv_w", "o_w", "gate_up_w", "down_w"):
        got = getattr(blocks.layers[7], attr)
        assert isinstance(got, BlockWeight) and got.kind == "q4"
        assert torch.equal(got.dequantize(), getattr(dense.layers[7], attr))  # Q/K unpermuted too
    assert isinstance(blocks.lm_head, BlockWeight) and blocks.lm_head.kind == "q8"  # tied head
    # the lookup reads the head's blocks (no dense copy), bitwise the dense matrix's rows
    assert blocks.embed_blocks is blocks.lm_head and blocks.embed.numel() == 0
    ids = torch.tensor([0, 7, 49151, 7, 12000])
    assert torch.equal(blocks.embed_rows(ids), dense.embed_rows(ids))
    assert torch.equal(dense.embed_rows(ids), dense.embed[ids])
    assert not any(p.dim() == 2 and p.shape[0] > 1000 for p in blocks.layers[0].parameters())


@pytest.fixture(scope="module")
def greedy_dense_and_blocks() -> dict[str, list[kvpark.RequestOutput]]:
    torch.set_num_threads(1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    out = {}
    for weights in ("dense", "blocks"):
        # float32 cells: a bf16 pool rounds each path's K and V, which would blur what is compared
        llm = kvpark.LLM(
            dtype="float32",
            weights=weights,
            kv_cells=2048,
            kv_dtype="float32",
            block_dot="float32",  # the blocks' exact weights; int8 rounds the activations
        )
        out[weights] = llm.generate(PROMPTS, params)
    return out


def test_blocks_give_the_dense_models_greedy_tokens(
    greedy_dense_and_blocks: dict[str, list[kvpark.RequestOutput]],
) -> None:
    dense, blocks = greedy_dense_and_blocks["dense"], greedy_dense_and_blocks["blocks"]
    for d, b in zip(dense, blocks, strict=True):
        assert b.token_ids == d.token_ids and len(d.token_ids) == 32
        got, want = b.choices[0].logprobs or [], d.choices[0].logprobs or []
        assert len(got) == len(want) == 32
        for lb, ld in zip(got, want, strict=True):
            bound = LOGPROB_RELATIVE * abs(ld.logprob) + LOGPROB_ABSOLUTE
            assert abs(lb.logprob - ld.logprob) <= bound


def test_exact_mode_with_blocks_is_bitwise_beside_neighbours() -> None:
    torch.set_num_threads(1)
    llm = kvpark.LLM(dtype="float32", weights="blocks", exact=True, kv_cells=2048)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    alone = llm.generate([PROMPTS[0]], params)[0].choices[0]
    together = llm.generate(PROMPTS + ["Once upon a time,"] * 4, params)[0].choices[0]
    assert together.token_ids == alone.token_ids and len(alone.token_ids) == 12
    assert together.logprobs == alone.logprobs  # every logprob, to the bit


def test_the_weights_setting_resolves_per_device_and_dtype() -> None:
    assert resolve_weights("auto", CPU, torch.float32) is True
    assert resolve_weights("auto", CPU, torch.bfloat16) is False
    assert resolve_weights("auto", torch.device("cuda"), torch.float32) is False
    assert resolve_weights("dense", CPU, torch.float32) is False
    with pytest.raises(ValueError, match="CPU in float32"):
        resolve_weights("blocks", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown weights"):
        resolve_weights("int3", CPU, torch.float32)
    args = cli.build_parser().parse_args(["serve", "--weights", "dense"])
    assert engine_config(args, args.parser).model.weights == "dense"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--weights", "int3"])


def test_rms_norm_in_one_call_matches_torch_and_falls_back() -> None:
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(5, 64, generator=gen), torch.randn(64, generator=gen)
    torch.testing.assert_close(norm.rms_norm_cpu(x, w, 1e-6), norm.rms_norm(x, w, 1e-6))
    # not contiguous: the same kernel over a contiguous copy (a row's bits must not depend on
    # whether its view was strided: a lone row's view of QKV rows is contiguous, several rows'
    # are not), close to torch's
    strided = torch.randn(5, 128)[:, ::2]
    got = norm.rms_norm_cpu(strided, w, 1e-6)
    assert torch.equal(got, norm.rms_norm_cpu(strided.contiguous(), w, 1e-6))
    torch.testing.assert_close(got, norm.rms_norm(strided, w, 1e-6))
    half = x.to(torch.bfloat16)  # not float32: torch's, in float32 (Hugging Face's order)
    assert torch.equal(
        norm.rms_norm_cpu(half, w.to(torch.bfloat16), 1e-6),
        norm.rms_norm(half, w.to(torch.bfloat16), 1e-6),
    )
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm_cpu(x, torch.randn(32), 1e-6)


def test_cpu_kernel_threads_do_not_change_results() -> None:
    raw = random_blocks(GGMLQuantizationType.Q4_1, 512, 256, seed=3)
    w = BlockWeight.from_gguf(3, torch.from_numpy(raw.reshape(-1).copy()), (512, 256))
    x = torch.randn(9, 256)
    block_weights.set_threads(1)
    one = block_linear(x, w)
    block_weights.set_threads(3)
    try:
        assert torch.equal(block_linear(x, w), one)
    finally:
        block_weights.set_threads(1)
