"""The torch-free weights of the lean CPU runner (model/numpy_weights.py) against the torch model
the native runner hands the same decoder: tiny GGUF files of each variant (Llama's permuted Q/K
rows and rope factors, Qwen2's biases and an untied head, Qwen3's per-head norms), written here
with the ``gguf`` package's quantisers, must give the same arrays bit for bit; a file the
decoder cannot run whole is refused with the tensor named."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from kvpark.model import gguf_loader
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.gguf_file import GgufFile
from kvpark.model.llama import Block, LlamaModel
from kvpark.model.numpy_weights import Unfit, load_numpy_weights
from kvpark.model.ops import BlockWeight
from kvpark.model.rope_angles import rope_angles
from support.kquants import random_kquant

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 256, 4, 2, 512, 96, 2
HEAD_DIM = HIDDEN // HEADS


def write_tiny(
    path: Path,
    arch: str,
    *,
    attn: Q = Q.Q4_0,
    mlp: Q = Q.Q8_0,
    embed: Q = Q.Q4_1,
    head: Q | None = None,
    norms: Q = Q.F32,
    bias: bool = False,
    qk_norm: bool = False,
    rope_freqs: bool = False,
    mixed_qkv: bool = False,
) -> None:
    """A 2-layer model with random weights; ``head`` None: tied to the embedding."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_feed_forward_length(FFN)
    w.add_context_length(64)
    w.add_layer_norm_rms_eps(1e-5)

    def matrix(name: str, rows: int, cols: int, qtype: Q) -> None:
        x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
        if qtype == Q.F32:
            w.add_tensor(name, x)
        elif qtype == Q.Q6_K:
            w.add_tensor(name, random_kquant(qtype, rows, cols, seed=rows), raw_dtype=qtype)
        else:
            w.add_tensor(name, quants.quantize(x, qtype), raw_dtype=qtype)

    def vector(name: str, n: int) -> None:
        x = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        if norms == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, x)

    matrix("token_embd.weight", VOCAB, HIDDEN, embed)
    if head is not None:
        matrix("output.weight", VOCAB, HIDDEN, head)
    vector("output_norm.weight", HIDDEN)
    if rope_freqs:
        vector("rope_freqs.weight", HEAD_DIM // 2)
    for i in range(LAYERS):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", HIDDEN)
        vector(p + "ffn_norm.weight", HIDDEN)
        matrix(p + "attn_q.weight", HEADS * HEAD_DIM, HIDDEN, attn)
        matrix(p + "attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN, attn)
        matrix(p + "attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN, Q.Q8_0 if mixed_qkv else attn)
        matrix(p + "attn_output.weight", HIDDEN, HEADS * HEAD_DIM, attn)
        matrix(p + "ffn_gate.weight", FFN, HIDDEN, mlp)
        matrix(p + "ffn_up.weight", FFN, HIDDEN, mlp)
        matrix(p + "ffn_down.weight", HIDDEN, FFN, mlp)
        if bias:
            for name, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                vector(p + f"attn_{name}.bias", n * HEAD_DIM)
        if qk_norm:
            vector(p + "attn_q_norm.weight", HEAD_DIM)
            vector(p + "attn_k_norm.weight", HEAD_DIM)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def torch_model(path: Path) -> LlamaModel:
    """The model the native runner builds its decoder over: blocks kept, float32."""
    g = gguf_loader.GgufFile(str(path))
    arch = gguf_loader.arch_from_gguf(g)
    model = LlamaModel(arch, torch.float32, torch.device("cpu"))
    for name, tensor in gguf_loader.iter_weights(g, arch, blocks=True):
        model.load_weight(name, tensor)
    model.finish_loading()
    return model


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
    assert same_vector(cos, theirs.rope.cos) and same_vector(sin, theirs.rope.sin)
    if "rope factors" in variant:  # the factors reached the table: it differs from the plain one
        plain, _ = rope_angles(ours.arch.inv_freq(), ours.arch.max_position)
        assert not np.array_equal(plain, cos)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(attn=Q.F32), "q_proj.weight is F32"),
        (dict(head=Q.Q6_K), "lm_head.weight is Q6_K"),
        (dict(mixed_qkv=True), "layer 0's qkv_w"),
    ],
)
def test_a_file_the_decoder_cannot_run_whole_is_unfit(
    tmp_path: Path, options: dict[str, object], named: str
) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama", **options)  # type: ignore[arg-type]
    with pytest.raises(Unfit, match=named):
        load_numpy_weights(GgufFile(str(path)))
