"""Where each Hugging Face tensor of a layer goes: its attribute in a layer of the model, and
which part of a fused matrix it is. One table for the torch model (llama.py) and the torch-free
CPU weights (numpy_weights.py); ``layer_names`` gives each architecture's.

Gemma names its norms differently: its ``post_attention_layernorm`` norms the attention's
output (Llama's is the MLP's input norm, Gemma's ``pre_feedforward_layernorm``). Phi-3 stores
Q/K/V and gate/up already fused (``WHOLE``)."""

from __future__ import annotations

import re

LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
MATRICES = {"qkv_w": 3, "o_w": 1, "gate_up_w": 2, "down_w": 1}  # attribute -> parts fused
WHOLE = -1  # the part of a tensor that is a fused matrix whole

# Hugging Face tensor name -> (attribute, slice of a fused matrix: index in (q, k, v) or (gate, up))
LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", None),
    "self_attn.q_proj.weight": ("qkv_w", 0),
    "self_attn.k_proj.weight": ("qkv_w", 1),
    "self_attn.v_proj.weight": ("qkv_w", 2),
    "self_attn.q_proj.bias": ("qkv_b", 0),
    "self_attn.k_proj.bias": ("qkv_b", 1),
    "self_attn.v_proj.bias": ("qkv_b", 2),
    "self_attn.o_proj.weight": ("o_w", None),
    "self_attn.o_proj.bias": ("o_b", None),
    "self_attn.q_norm.weight": ("q_norm", None),
    "self_attn.k_norm.weight": ("k_norm", None),
    "post_attention_layernorm.weight": ("mlp_norm", None),
    "mlp.gate_proj.weight": ("gate_up_w", 0),
    "mlp.up_proj.weight": ("gate_up_w", 1),
    "mlp.down_proj.weight": ("down_w", None),
}

_GEMMA = {
    "post_attention_layernorm.weight": ("post_attn_norm", None),
    "pre_feedforward_layernorm.weight": ("mlp_norm", None),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", None),
}
_PHI3 = {
    "self_attn.qkv_proj.weight": ("qkv_w", WHOLE),
    "mlp.gate_up_proj.weight": ("gate_up_w", WHOLE),
}


def layer_names(arch: str) -> dict[str, tuple[str, int | None]]:
    """The layer table of architecture ``arch`` (ModelArch.arch)."""
    if arch in ("gemma2", "gemma3"):
        return LAYER_NAMES | _GEMMA
    if arch == "phi3":
        return LAYER_NAMES | _PHI3
    return LAYER_NAMES
