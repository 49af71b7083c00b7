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
    "mlp.gate.weight": ("router_w", None),  # a mixture of experts' router
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


EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_EXPERT_PART = {"gate": ("gate_up_w", 0), "up": ("gate_up_w", 1), "down": ("down_w", None)}


def expert_attr(expert: int, attr: str) -> str:
    """The layer's matrix name of expert ``expert``'s ``attr`` (gate_up_w, down_w)."""
    return f"expert.{expert}.{attr}"


def layer_entry(arch: str, rest: str) -> tuple[str, int | None] | None:
    """Where a layer's tensor named ``rest`` (the part after ``model.layers.N.``) goes, or None."""
    m = EXPERT_RE.fullmatch(rest)
    if m is not None:
        attr, part = _EXPERT_PART[m.group(2)]
        return expert_attr(int(m.group(1)), attr), part
    return layer_names(arch).get(rest)


def layer_matrices(n_experts: int, moe: bool) -> dict[str, int]:
    """A layer's matrices and how many parts each fuses: a mixture of experts' layer has the
    router and each expert's gate/up and down instead of the dense MLP's."""
    if not moe:
        return MATRICES
    out = {"qkv_w": 3, "o_w": 1, "router_w": 1}
    for e in range(n_experts):
        out |= {expert_attr(e, "gate_up_w"): 2, expert_attr(e, "down_w"): 1}
    return out
