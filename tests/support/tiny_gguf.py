"""Tiny random GGUF files of each variant the readers take (Llama's permuted Q/K rows and rope
factors, Qwen2's biases, Qwen3's per-head norms, quant blocks, K-quants, dense F32/F16/BF16),
written with the ``gguf`` package's own writer and quantisers: the weight-reading tests compare
them with ``gguf``'s reading, the runner tests run them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

from support.iq4 import quantize_iq4
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
    v: Q | None = None,
    down: Q | None = None,
) -> None:
    """A 2-layer random model; ``head`` None: tied to the embedding; ``v``: V's type, if not Q's;
    ``down``: the down projection's, if not gate/up's (a Q4_K_M file's Q6_K ffn_down)."""
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
        elif qtype in (Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf cannot quantise K-quants
            w.add_tensor(name, random_kquant(qtype, rows, cols, seed=rows), raw_dtype=qtype)
        elif qtype in (Q.IQ4_NL, Q.IQ4_XS):  # nor the IQ4 types
            w.add_tensor(name, quantize_iq4(x, qtype), raw_dtype=qtype)
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
        v_type = v or (Q.Q8_0 if mixed_qkv else attn)
        matrix(p + "attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN, v_type)
        matrix(p + "attn_output.weight", HIDDEN, HEADS * HEAD_DIM, attn)
        matrix(p + "ffn_gate.weight", FFN, HIDDEN, mlp)
        matrix(p + "ffn_up.weight", FFN, HIDDEN, mlp)
        matrix(p + "ffn_down.weight", HIDDEN, FFN, down or mlp)
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
