"""The numpy weights (model/numpy_weights.py) the lean CPU runner's decoder runs and the torch
model is built over: tiny GGUF files of each variant (Llama's permuted Q/K rows and rope factors,
Qwen2's biases and an untied head, Qwen3's per-head norms, K-quants), written here with the
``gguf`` package's quantisers, must give the torch model the same arrays bit for bit, and both
the values ``gguf`` itself reads and dequantises (unpermuted and fused here, independently); dense
F32/F16/BF16 matrices are kept as stored, and a file the decoder cannot run whole is refused
with the tensor named."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from kvpark.model.gguf_blocks import Blocks
from kvpark.model.gguf_file import GgufFile, hf_name
from kvpark.model.llama import Block, LlamaModel
from kvpark.model.numpy_weights import Unfit, decoder_unfit, load_numpy_weights, read_gguf
from kvpark.model.ops import BlockWeight
from kvpark.model.rope_angles import rope_angles
from kvpark.model.torch_weights import torch_model as torch_model_over
from kvpark.model.weight_arrays import Stacked, widened
from support.tiny_gguf import HEADS, KV_HEADS, LAYERS, write_tiny


def torch_model(path: Path, blocks: bool = True, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """The torch model over the file as load_model builds it (the tiny files carry no
    tokenizer): blocks kept (or not), float32 unless told."""
    dense_dtype = str(dtype).removeprefix("torch.")
    weights = read_gguf(GgufFile(str(path)), blocks=blocks, dense_dtype=dense_dtype)
    return torch_model_over(weights, dtype, torch.device("cpu"))


def reference(path: Path) -> dict[str, np.ndarray]:
    """Every weight as ``gguf``'s reader and dequantiser give it (float32), under the model's
    names: Q/K rows unpermuted (GGUF rows 2i, 2i + 1 of a head are rows i, i + d/2), Q/K/V and
    gate/up fused, with no code of ours but the name table."""
    llama = gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == "llama"
    out: dict[str, np.ndarray] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        values = quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        name = hf_name(t.name)
        heads = HEADS if ".q_proj." in name else KV_HEADS if ".k_proj." in name else 0
        if llama and heads:
            rows = shape[0]
            values = values.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(shape)
        out[name] = values
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "qkv_w"] = np.concatenate([out[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[p + "gate_up_w"] = np.concatenate(
            [out[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]
        )
        out[p + "o_w"] = out[p + "self_attn.o_proj.weight"]
        out[p + "down_w"] = out[p + "mlp.down_proj.weight"]
    out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out


def same_weights(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bits, but for the sign of a zero: a Q4_0 block of negative scale holds -0.0 where
    gguf computes (8 - 8) * d, +0.0 where blocks compute d * 8 + -8 * d (the same value)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    return bool(((got.view(np.int32) == want.view(np.int32)) | ((got == 0) & (want == 0))).all())


def dequantised(m: object) -> np.ndarray:
    if isinstance(m, BlockWeight):
        return m.dequantize().numpy()
    if isinstance(m, torch.Tensor):
        return m.detach().numpy()
    return m.dequantize() if isinstance(m, Blocks) else widened(np.asarray(m)).astype(np.float32)


def same_blocks(ours: Blocks, theirs: object) -> bool:
    assert isinstance(theirs, BlockWeight)
    pairs = [(ours.qs, theirs.qs), (ours.scale, theirs.scale)]
    if ours.offset is not None or theirs.offset is not None:
        assert ours.offset is not None and theirs.offset is not None
        pairs.append((ours.offset, theirs.offset))
    return ours.kind == theirs.kind and all(
        a.dtype.itemsize == b.element_size() and a.tobytes() == b.numpy().tobytes()
        for a, b in pairs
    )


def same_vector(ours: np.ndarray | None, theirs: torch.Tensor | None) -> bool:
    if ours is None or theirs is None:
        return ours is None and theirs is None
    return ours.dtype == np.float32 and ours.tobytes() == theirs.detach().numpy().tobytes()


VARIANTS = {
    "llama: permuted Q/K, untied Q4_0 head, f16 norms, rope factors": dict(
        arch="llama", head=Q.Q4_0, norms=Q.F16, rope_freqs=True
    ),
    "qwen2: biases, tied Q8_0 embedding": dict(arch="qwen2", bias=True, embed=Q.Q8_0),
    "qwen3: per-head norms, Q4_1 layers": dict(arch="qwen3", qk_norm=True, attn=Q.Q4_1),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_numpy_weights_are_the_torch_models_bit_for_bit(tmp_path: Path, variant: str) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(path, **VARIANTS[variant])  # type: ignore[arg-type]
    ours, theirs = load_numpy_weights(GgufFile(str(path))), torch_model(path)
    assert ours.arch == theirs.arch
    for layer, module in zip(ours.layers, theirs.layers, strict=True):
        block = module
        assert isinstance(block, Block)
        for attr in ("qkv_w", "o_w", "gate_up_w", "down_w"):
            assert same_blocks(layer.matrices[attr], getattr(block, attr)), attr
        for attr in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
            assert same_vector(layer.vectors.get(attr), getattr(block, attr)), attr
        assert same_vector(layer.vectors.get("qkv_b"), block.qkv_b)
    assert same_blocks(ours.embed, theirs.embed_blocks)
    assert same_blocks(ours.head, theirs.lm_head)
    assert (ours.head is ours.embed) == ours.arch.tie_embeddings
    assert same_vector(ours.norm, theirs.norm)
    cos, sin = rope_angles(ours.arch.inv_freq(ours.rope_freqs), ours.arch.max_position)
    assert same_vector(cos, theirs.ropes[0].cos) and same_vector(sin, theirs.ropes[0].sin)
    if "rope factors" in variant:  # the factors reached the table: it differs from the plain one
        plain, _ = rope_angles(ours.arch.inv_freq(), ours.arch.max_position)
        assert not np.array_equal(plain, cos)
    assert_as_gguf_reads(path, ours.layers, ours.embed, ours.head)


def assert_as_gguf_reads(path: Path, layers: list[object], embed: object, head: object) -> None:
    """Every matrix (numpy ``Blocks`` or arrays, or the torch model's layers) dequantises to
    what gguf reads from the file."""
    want = reference(path)
    for i, layer in enumerate(layers):
        for attr in ("qkv_w", "o_w", "gate_up_w", "down_w"):
            m = layer.matrices[attr] if hasattr(layer, "matrices") else getattr(layer, attr)
            assert same_weights(dequantised(m), want[f"model.layers.{i}.{attr}"]), (i, attr)
    assert same_weights(dequantised(embed), want["model.embed_tokens.weight"])
    assert same_weights(dequantised(head), want["lm_head.weight"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_dense_torch_model_holds_what_gguf_reads(tmp_path: Path, variant: str) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(path, **VARIANTS[variant])  # type: ignore[arg-type]
    model = torch_model(path, blocks=False)
    assert all(isinstance(b.qkv_w, torch.nn.Parameter) for b in model.layers)
    want = reference(path)
    assert_as_gguf_reads(path, list(model.layers), model.embed, model.lm_head)
    for i, block in enumerate(model.layers):  # dense: bit for bit, the zeros' signs included
        got = block.qkv_w.detach().numpy()  # type: ignore[union-attr]
        assert got.tobytes() == want[f"model.layers.{i}.qkv_w"].tobytes()
    for dtype in (torch.bfloat16, torch.float16):  # rounded as torch rounds a float32 copy
        small = torch_model(path, blocks=False, dtype=dtype)
        for i, block in enumerate(small.layers):
            for attr in ("qkv_w", "gate_up_w", "attn_norm"):
                rounded = torch.from_numpy(np.asarray(dequantised(getattr(model.layers[i], attr))))
                got_t = getattr(block, attr).detach()
                assert got_t.dtype == dtype and torch.equal(
                    got_t.view(torch.int16), rounded.to(dtype).view(torch.int16)
                ), (dtype, attr)
        # the rope factors kept their bits
        assert torch.equal(
            small.ropes[0].cos, model.ropes[0].cos
        )  # the rope factors kept their bits


K_QUANT_FILES = {
    "Q4_K layers, Q5_K MLP, Q4_K embedding and head": dict(
        attn=Q.Q4_K, mlp=Q.Q5_K, embed=Q.Q4_K, head=Q.Q4_K, rope_freqs=True
    ),
    "Q5_K beside Q8_0 in one fused Q/K/V": dict(attn=Q.Q5_K, mixed_qkv=True, embed=Q.Q8_0),
}


@pytest.mark.parametrize("options", list(K_QUANT_FILES))
def test_a_k_quant_file_is_decoder_weights_gguf_dequantises_alike(
    tmp_path: Path, options: str
) -> None:
    path = tmp_path / "kquants.gguf"
    write_tiny(path, "llama", **K_QUANT_FILES[options])  # type: ignore[arg-type]
    ours = load_numpy_weights(GgufFile(str(path)))
    assert decoder_unfit(ours) is None
    assert all(isinstance(m, Blocks) for layer in ours.layers for m in layer.matrices.values())
    kinds = {attr: m.kind for attr, m in ours.layers[0].matrices.items()}
    gate_up = ours.layers[0].matrices["gate_up_w"]  # Q5_K has offsets (its mins), Q8_0 none
    assert kinds["gate_up_w"] == "q8" and (gate_up.offset is None) == ("Q5_K MLP" not in options)
    assert kinds["qkv_w"] == ("q4" if "Q4_K layers" in options else "q8")
    assert ours.layers[0].matrices["qkv_w"].offset is not None  # the K-quants' mins
    want = reference(path)
    for i, layer in enumerate(ours.layers):  # K-quants and Q8_0: bit for bit, zeros included
        for attr, m in layer.matrices.items():
            assert dequantised(m).tobytes() == want[f"model.layers.{i}.{attr}"].tobytes()
    assert dequantised(ours.embed).tobytes() == want["model.embed_tokens.weight"].tobytes()
    theirs = torch_model(path)
    assert_as_gguf_reads(path, list(theirs.layers), theirs.embed_blocks, theirs.lm_head)
    for layer, block in zip(ours.layers, theirs.layers, strict=True):
        for attr in ("qkv_w", "o_w", "gate_up_w", "down_w"):
            assert same_blocks(layer.matrices[attr], getattr(block, attr)), attr


def test_a_q4_k_m_file_is_decoder_weights_the_torch_model_shares(tmp_path: Path) -> None:
    """Q4_K attention and gate/up, Q6_K down and head (its own kind, q6: int8 with a scale per
    16), a Q8_0 embedding: every matrix blocks, dequantising to what gguf reads, bit for bit."""
    path = tmp_path / "q4_k_m.gguf"
    write_tiny(path, "llama", attn=Q.Q4_K, mlp=Q.Q4_K, down=Q.Q6_K, head=Q.Q6_K, embed=Q.Q8_0)
    ours = load_numpy_weights(GgufFile(str(path)))
    assert decoder_unfit(ours) is None
    kinds = {attr: getattr(m, "kind", None) for attr, m in ours.layers[0].matrices.items()}
    assert kinds == {"qkv_w": "q4", "o_w": "q4", "gate_up_w": "q4", "down_w": "q6"}
    assert isinstance(ours.head, Blocks) and ours.head.kind == "q6"
    assert_as_gguf_reads(path, ours.layers, ours.embed, ours.head)
    theirs = torch_model(path)
    assert same_blocks(ours.head, theirs.lm_head)
    for layer, block in zip(ours.layers, theirs.layers, strict=True):
        assert same_blocks(layer.matrices["down_w"], block.down_w)


REFUSED = {  # one case per thing the decoder cannot multiply
    "a TQ1_0 head": (dict(head=Q.TQ1_0), "lm_head.weight is TQ1_0"),
    "TQ1_0 MLP matrices": (dict(mlp=Q.TQ1_0), "gate_proj.weight is TQ1_0"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_file_the_decoder_cannot_run_whole_is_unfit(tmp_path: Path, case: str) -> None:
    """A quant type without a product: the torch model's."""
    options, named = REFUSED[case]
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama", **options)  # type: ignore[arg-type]
    with pytest.raises(Unfit, match=named):
        load_numpy_weights(GgufFile(str(path)))
    assert re.search(named, decoder_unfit(read_gguf(GgufFile(str(path)), blocks=True)) or "")
    model = torch_model(path)
    assert_as_gguf_reads(path, list(model.layers), model.embed_blocks, model.lm_head)


MIXED = {  # a fused Q/K/V of two kinds -> its parts' kinds (q, k, v)
    "Q5_0 V beside Q4_0": (dict(attn=Q.Q4_0, v=Q.Q5_0), ("q4", "q4", "q8")),
    "Q6_K V beside Q4_K (a Q4_K_M file's)": (dict(attn=Q.Q4_K, v=Q.Q6_K), ("q4", "q4", "q6")),
    "Q8_0 V beside Q4_0": (dict(mixed_qkv=True), ("q4", "q4", "q8")),
    "Q8_0 V beside Q4_K": (dict(attn=Q.Q4_K, mixed_qkv=True), ("q4", "q4", "q8")),
    "F16 V beside Q4_0": (dict(attn=Q.Q4_0, v=Q.F16), ("q4", "q4", "float16")),
    "BF16 V beside F16": (dict(attn=Q.F16, v=Q.BF16), ("float16", "float16", "uint16")),
}


@pytest.mark.parametrize("case", list(MIXED))
def test_a_fused_matrix_of_two_kinds_keeps_its_parts(tmp_path: Path, case: str) -> None:
    """Each part as the file stores it (no float32 copy), dequantising to what gguf reads bit
    for bit; the torch model takes their float32 values joined."""
    options, kinds = MIXED[case]
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama", **options)  # type: ignore[arg-type]
    ours = load_numpy_weights(GgufFile(str(path)))
    assert decoder_unfit(ours) is None
    want = reference(path)
    for i, layer in enumerate(ours.layers):
        qkv = layer.matrices["qkv_w"]
        assert isinstance(qkv, Stacked)
        got = tuple(p.kind if isinstance(p, Blocks) else p.dtype.name for p in qkv.parts)
        assert got == kinds
        # values equal (Q4_0 gives +0.0 where gguf computes (q - 8) * d = -0.0 for d < 0)
        assert np.array_equal(qkv.dequantize(), want[f"model.layers.{i}.qkv_w"])
    model = torch_model(path)
    assert_as_gguf_reads(path, list(model.layers), model.embed_blocks, model.lm_head)


DENSE_FILES = {  # F16 tied, BF16 untied, F32 beside Q8_0 MLP blocks; kept as stored, no copy
    Q.F16: dict(attn=Q.F16, mlp=Q.F16, embed=Q.F16),
    Q.BF16: dict(attn=Q.BF16, mlp=Q.BF16, embed=Q.BF16, head=Q.BF16),
    Q.F32: dict(attn=Q.F32),
}


@pytest.mark.parametrize("qtype", list(DENSE_FILES), ids=lambda q: q.name)
def test_dense_matrices_are_decoder_weights_in_the_files_dtype(tmp_path: Path, qtype: Q) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama", **DENSE_FILES[qtype])  # type: ignore[arg-type]
    ours = load_numpy_weights(GgufFile(str(path)))
    assert decoder_unfit(ours) is None and not ours.unfit_why
    dtype = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16}[qtype]
    assert all(ours.layers[0].matrices[m].dtype == dtype for m in ("qkv_w", "o_w"))
    assert (ours.head is ours.embed) == ("head" not in DENSE_FILES[qtype])
    assert_as_gguf_reads(path, ours.layers, ours.embed, ours.head)
