"""Tiny random checkpoints of the architectures beyond Llama and Qwen (Gemma 2, Gemma 3, Phi-3,
Mistral with a sliding window), built by transformers from configs with seeded random weights,
saved as safetensors with the default model's tokenizer, and written again as GGUF the way
llama.cpp's converter writes them (its tensor names and metadata keys, Gemma's norms as 1 + w,
Phi-3's fused matrices and LongRoPE factors, Llama's permuted Q/K rows), in F32, F16, Q8_0 or
Q4_K. Windows are 8 positions and the test prompts longer, so the sliding layers slide."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from kvpark.tokenizer.tokenizer import Tokenizer
from support import kquants
from support.tiny_hf import TEMPLATE

WINDOW = 8
COMMON: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=512,
)
_HALF = COMMON["head_dim"] // 2
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": (
        "Gemma2Config",
        dict(
            num_hidden_layers=4,
            query_pre_attn_scalar=48,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,  # low enough that random scores reach the tanh's bend
            final_logit_softcapping=8.0,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=4,
            query_pre_attn_scalar=64,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            },
        ),
    ),
    "phi3": (
        "Phi3Config",
        dict(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            max_position_embeddings=256,  # the trained context: the short factors
            original_max_position_embeddings=256,
            pad_token_id=0,
            eos_token_id=2,
            bos_token_id=1,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(_HALF)],
                "long_factor": [1.0 + 0.5 * i for i in range(_HALF)],
                "original_max_position_embeddings": 256,
                "attention_factor": 1.2,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "qwen3moe": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            norm_topk_prob=True,
            sliding_window=None,
        ),
    ),
}


def save_arch(kind: str, tokenizer: Tokenizer, root: Path, **overrides: Any) -> Any:
    """The transformers model of ``kind`` (seeded random weights, norms around 1 or, for
    Gemma's ``1 + w`` norms, around 0) saved in ``root`` with the tokenizer and a template."""
    import transformers

    config_class, extra = ARCHS[kind]
    config = getattr(transformers, config_class)(**(COMMON | extra | overrides))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gemma = kind.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name
            p.normal_(0.0 if gemma or not norm else 1.0, 0.1 if norm else 0.05)
    model.save_pretrained(str(root))
    tokenizer.backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": TEMPLATE})
    )
    return model


# ---------------------------------------------------------------- as llama.cpp writes GGUF
_ARCH = {
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "mistral": "llama",
    "qwen3moe": "qwen3moe",
}
_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up in one tensor
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "pre_feedforward_layernorm": "ffn_norm",
    "mlp.gate_exps": "ffn_gate_exps",
    "mlp.up_exps": "ffn_up_exps",
    "mlp.down_exps": "ffn_down_exps",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _gguf_name(kind: str, hf: str) -> str:
    glob = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if hf in glob:
        return glob[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    if module == "post_attention_layernorm":  # Gemma's norms the attention's output
        name = "post_attention_norm" if kind.startswith("gemma") else "ffn_norm"
    else:
        name = _NAMES[module]
    return f"blk.{i}.{name}.{leaf}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a Llama Q or K (its interleaved rope)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _tokenizer_fields(w: gguf.GGUFWriter, source: dict[str, Any]) -> None:
    """The default model's tokenizer, copied from its GGUF's metadata (``source``)."""
    w.add_tokenizer_model(source["tokenizer.ggml.model"])
    w.add_tokenizer_pre(source["tokenizer.ggml.pre"])
    w.add_token_list(source["tokenizer.ggml.tokens"])
    w.add_token_types(source["tokenizer.ggml.token_type"])
    w.add_token_merges(source["tokenizer.ggml.merges"])
    w.add_bos_token_id(source["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(source["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)


def write_gguf(
    kind: str, model: Any, path: Path, qtype: Q, tokenizer_metadata: dict[str, Any]
) -> None:
    """``model`` (save_arch's) as llama.cpp's converter writes it, its matrices in ``qtype``,
    with the tokenizer of ``tokenizer_metadata`` (the default model's GGUF metadata)."""
    cfg = model.config
    arch = _ARCH[kind]
    w = gguf.GGUFWriter(str(path), arch)
    _tokenizer_fields(w, tokenizer_metadata)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(
        cfg.head_dim if hasattr(cfg, "head_dim") else cfg.hidden_size // cfg.num_attention_heads
    )
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    if kind == "gemma2":
        if cfg.attn_logit_softcapping is not None:
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if cfg.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_float32(f"{arch}.attention.scale", cfg.query_pre_attn_scalar**-0.5)
    elif kind == "gemma3":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
        w.add_float32(f"{arch}.attention.scale", cfg.query_pre_attn_scalar**-0.5)
        sliding = [t == "sliding_attention" for t in cfg.layer_types]
        w.add_array(f"{arch}.attention.sliding_window_pattern", sliding)
    elif kind == "phi3":
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(rope["attention_factor"])
        for which in ("long", "short"):
            w.add_tensor(
                f"rope_factors_{which}.weight", np.array(rope[f"{which}_factor"], np.float32)
            )
    if kind == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    tied = getattr(cfg, "tie_word_embeddings", False)
    state = _experts_stacked(model.state_dict()) if kind == "qwen3moe" else model.state_dict()
    for name, p in state.items():
        if name == "lm_head.weight" and tied:
            continue
        x = p.detach().float().numpy()
        if kind.startswith("gemma") and name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            x = _permute(x, heads)
        gname = _gguf_name(kind, name)
        if x.ndim == 1 or qtype == Q.F32 or name.endswith("mlp.gate.weight"):
            w.add_tensor(gname, x)  # vectors and the router stay F32, as llama.cpp keeps them
        elif qtype == Q.F16:
            w.add_tensor(gname, x.astype(np.float16))
        elif qtype == Q.Q4_K:
            packed = kquants.quantize(x.reshape(-1, x.shape[-1]), qtype)
            w.add_tensor(gname, packed.reshape(*x.shape[:-1], -1), raw_dtype=qtype)
        else:
            w.add_tensor(gname, quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _experts_stacked(state: dict[str, Any]) -> dict[str, Any]:
    """transformers' fused expert tensors (gate_up_proj [experts, 2 * width, hidden], gate
    first; down_proj [experts, hidden, width]) as llama.cpp's one 3-D tensor per layer and
    kind, under the names ``_gguf_name`` maps to ``ffn_*_exps``."""
    out: dict[str, Any] = {}
    for name, p in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            layer = name.removesuffix(".experts.gate_up_proj")
            gate, up = p.chunk(2, dim=1)
            out[f"{layer}.gate_exps.weight"], out[f"{layer}.up_exps.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            out[name.removesuffix(".experts.down_proj") + ".down_exps.weight"] = p
        else:
            out[name] = p
    return out
