"""A GGUF file's architecture (``ModelArch``) from its metadata, as llama.cpp reads the same
keys: sizes, rope base and scaling (linear; Phi-3's LongRoPE from its ``rope_factors_*``
tensors), sliding windows (a file's own per-layer list, else llama.cpp's layout for the
architecture), Gemma's switches (GeGLU, scaled embedding, sandwich norms, soft-caps, score
scale; Gemma 3's sliding layers on rope base 10000)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpark.model.arch import SUPPORTED_ARCHS, ModelArch, ModelLoadError, RopeScaling
from kvpark.model.gguf_file import GgufFile


def arch_from_gguf(g: GgufFile) -> ModelArch:
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"{g.path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{g.path}: metadata lacks {arch}.{name}")
        if isinstance(value, list):
            raise ModelLoadError(f"{g.path}: per-layer {arch}.{name} is not supported")
        return value

    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    n_layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // n_heads))
    embed = next((t for t in g.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelLoadError(f"{g.path}: no token_embd.weight tensor")
    gemma = arch in ("gemma2", "gemma3")
    max_position = int(key("context_length"))
    window, sliding = _sliding(g, arch, n_layers, max_position)
    return ModelArch(
        arch=arch,
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        intermediate_size=int(md.get(f"{arch}.feed_forward_length") or 0),
        vocab_size=embed.shape[1],
        rope_theta=float(key("rope.freq_base", 1e6 if arch == "gemma3" else 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position=max_position,
        tie_embeddings=not g.has_tensor("output.weight"),
        qkv_bias=g.has_tensor("blk.0.attn_q.bias"),
        o_bias=g.has_tensor("blk.0.attn_output.bias"),
        qk_norm=g.has_tensor("blk.0.attn_q_norm.weight"),
        rope_scaling=_rope_scaling(g, arch),
        activation="gelu_tanh" if gemma else "silu",
        embed_scale=float(np.float32(hidden**0.5)) if gemma else 1.0,
        sandwich_norms=gemma,
        attn_scale=_attention_scale(md, arch, n_layers, hidden, n_heads),
        attn_softcap=_softcap(md, arch, "attn", 50.0),
        final_softcap=_softcap(md, arch, "final", 30.0),
        sliding_window=window,
        sliding_layers=sliding,
        local_rope_theta=_local_rope_base(md, arch),
        **_experts(md, arch, n_layers),
    )


def _experts(md: dict[str, Any], arch: str, n_layers: int) -> dict[str, Any]:
    """A mixture of experts' sizes (every layer's MLP is one in llama.cpp's qwen3moe)."""
    n = int(md.get(f"{arch}.expert_count") or 0)
    if n == 0:
        return {}
    return dict(
        n_experts=n,
        experts_per_token=int(md[f"{arch}.expert_used_count"]),
        expert_size=int(md[f"{arch}.expert_feed_forward_length"]),
        norm_topk=bool(md.get(f"{arch}.expert_weights_norm", True)),
        moe_layers=(True,) * n_layers,
    )


# Gemma's sliding layers, as llama.cpp lays them out where a file does not list them: one
# in two (from layer 0) for Gemma 2, five in six for Gemma 3
_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}


def _sliding(
    g: GgufFile, arch: str, n_layers: int, max_position: int
) -> tuple[int | None, tuple[bool, ...]]:
    md = g.metadata
    window = md.get(f"{arch}.attention.sliding_window")
    if not window or int(window) >= max_position:
        return None, ()
    listed = md.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(listed, list):
        sliding = tuple(bool(v) for v in listed)
    elif arch in _SLIDING_PATTERN:
        n = int(listed) if isinstance(listed, int) else _SLIDING_PATTERN[arch]
        sliding = tuple(i % n < n - 1 for i in range(n_layers))
    else:  # Mistral, Phi-3: every layer
        sliding = (True,) * n_layers
    if len(sliding) != n_layers:
        raise ModelLoadError(
            f"{g.path}: sliding-window flags for {len(sliding)} of {n_layers} layers"
        )
    return int(window), sliding


def _softcap(md: dict[str, Any], arch: str, which: str, gemma2_default: float) -> float | None:
    """A Gemma's soft-cap (``attn`` or ``final``): the file's, else llama.cpp's default (Gemma 2:
    50 and 30; Gemma 3 has only a final one, none by default); 0 is none."""
    if arch not in ("gemma2", "gemma3") or (arch == "gemma3" and which == "attn"):
        return None
    default = gemma2_default if arch == "gemma2" else 0.0
    return float(md.get(f"{arch}.{which}_logit_softcapping", default)) or None


def _local_rope_base(md: dict[str, Any], arch: str) -> float | None:
    """The sliding layers' rope base where it is their own: a file's ``rope.freq_base_swa``,
    else Gemma 3's 10000 (llama.cpp's defaults)."""
    base = md.get(f"{arch}.rope.freq_base_swa")
    if base is not None:
        return float(base)
    return 10000.0 if arch == "gemma3" else None


def _attention_scale(
    md: dict[str, Any], arch: str, n_layers: int, hidden: int, n_heads: int
) -> float | None:
    """A file's ``attention.scale``, else llama.cpp's rule for Gemma: 1 / sqrt(head_dim) but
    for the 27B models (46 and 62 layers), whose ``query_pre_attn_scalar`` is hidden / heads."""
    scale = md.get(f"{arch}.attention.scale")
    if scale is not None:
        return float(scale)
    if arch in ("gemma2", "gemma3") and n_layers in (46, 62):
        return float((hidden / n_heads) ** -0.5)
    return None


def _rope_scaling(g: GgufFile, arch: str) -> RopeScaling | None:
    md = g.metadata
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return RopeScaling("linear", float(md[f"{arch}.rope.scaling.factor"]))
    if kind not in ("none", None):
        raise ModelLoadError(f"{g.path}: rope scaling {kind!r} is not supported")
    if arch == "phi3" and g.has_tensor("rope_factors_long.weight"):
        factors = {}
        for which in ("long", "short"):
            info = next(t for t in g.tensors if t.name == f"rope_factors_{which}.weight")
            qtype, raw = g.raw(info)
            if qtype.name != "F32":
                raise ModelLoadError(f"{g.path}: rope factors of type {qtype.name}")
            factors[which] = tuple(float(v) for v in raw.view(np.float32))
        original = int(md.get(f"{arch}.rope.scaling.original_context_length", 4096))
        context = int(md[f"{arch}.context_length"])
        return RopeScaling(
            "longrope",
            context / original,
            original_max_position=original,
            short_factor=factors["short"],
            long_factor=factors["long"],
            attention_factor=float(md.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
        )
    return None
