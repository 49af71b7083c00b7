"""Read a Hugging Face model directory: config.json, *.safetensors (into numpy, without torch:
safetensors_file.py), tokenizer.json and its config.

Both config spellings are understood: transformers 4's ``rope_theta`` / ``rope_scaling`` and
transformers 5's ``rope_parameters``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvpark.model.arch import ModelArch, ModelLoadError, RopeScaling
from kvpark.model.safetensors_file import SafetensorsFile
from kvpark.model.weight_arrays import NamedTensor, converted, widened
from kvpark.tokenizer.tokenizer import Tokenizer

# config.json model_type -> our variant. Mistral is a Llama with a sliding window.
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",  # and gemma3 (multimodal): its text_config (text_config below)
    "phi3": "phi3",
    "qwen3_moe": "qwen3moe",
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
GEMMA = ("gemma2", "gemma3")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


# a multimodal checkpoint's parts that are not its language model: skipped (kvpark serves text)
_NOT_TEXT: tuple[str, ...] = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
# prefixes of a multimodal checkpoint's language model (transformers 4's and 5's spellings)
_TEXT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 (``model_type`` gemma3, with a ``text_config``) read as its language
    model, Gemma 3 text; any other config as it is."""
    if cfg.get("model_type") != "gemma3" or not isinstance(cfg.get("text_config"), dict):
        return cfg
    text = {"model_type": "gemma3_text", **cfg["text_config"]}
    text["model_type"] = "gemma3_text"
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    return text


def text_name(name: str) -> str | None:
    """A tensor's name in the language model (a multimodal checkpoint's prefix dropped), or None
    for a tensor of another part (the vision tower, the projector)."""
    if name.startswith(_NOT_TEXT):
        return None
    for prefix, plain in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return plain + name.removeprefix(prefix)
    return name


def variant(cfg: dict[str, Any]) -> str:
    """Our variant for a config.json, or a ModelLoadError naming the unsupported architecture."""
    cfg = text_config(cfg)
    model_type = cfg.get("model_type")
    arch = _MODEL_TYPES.get(str(model_type))
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture: model_type {model_type!r} "
            f"({cfg.get('architectures')}); supported: {', '.join(sorted(_MODEL_TYPES))}"
        )
    return arch


def arch_from_config(cfg: dict[str, Any], has_lm_head: bool) -> ModelArch:
    cfg = text_config(cfg)
    model_type = cfg.get("model_type")
    arch = variant(cfg)
    act = _ACTIVATIONS.get(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
    if act is None or cfg.get("mlp_bias"):
        raise ModelLoadError(
            f"only SiLU or tanh-GELU MLPs without bias are supported ({model_type}: "
            f"{cfg.get('hidden_activation') or cfg.get('hidden_act')})"
        )
    hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    n_layers = int(cfg["num_hidden_layers"])
    max_position = int(cfg.get("max_position_embeddings", 4096))
    global_rope, local_rope = _rope_parameters(cfg)
    if float(global_rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"partial rotary embeddings are not supported ({model_type})")
    window, sliding = _sliding(cfg, n_layers, max_position)
    attention_bias = bool(cfg.get("attention_bias", False))
    gemma = arch in GEMMA
    n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    n_experts = n_experts if arch == "qwen3moe" else 0
    step, dense_only = int(cfg.get("decoder_sparse_step") or 1), cfg.get("mlp_only_layers") or []
    moe = tuple(
        n_experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(n_layers)
    )
    return ModelArch(
        arch=arch,
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rope_theta=float(global_rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=max_position,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)) or not has_lm_head,
        qkv_bias=arch == "qwen2" or attention_bias,
        o_bias=arch != "qwen2" and attention_bias,
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
        rope_scaling=_rope_scaling(global_rope, cfg),
        activation=act,
        embed_scale=float(np.float32(hidden**0.5)) if gemma else 1.0,
        sandwich_norms=gemma,
        attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
        attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
        final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
        sliding_window=window,
        sliding_layers=sliding,
        local_rope_theta=(
            float(local_rope.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
            if local_rope is not None
            else None
        ),
        n_experts=n_experts,
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if n_experts else 0,
        expert_size=int(cfg.get("moe_intermediate_size") or 0) if n_experts else 0,
        norm_topk=bool(cfg.get("norm_topk_prob", True)),
        moe_layers=moe if any(moe) else (),
    )


def _rope_parameters(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The full-attention layers' rope parameters, and the sliding layers' where they have
    their own (Gemma 3: transformers 5's per-layer-type dict, or 4's ``rope_local_base_freq``)."""
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:
        local = rope.get("sliding_attention")
        return dict(rope["full_attention"]), (dict(local) if local is not None else None)
    merged = dict(rope)
    if cfg.get("rope_scaling"):  # transformers 4's spelling
        merged |= cfg["rope_scaling"]
    if "rope_theta" in cfg and "rope_theta" not in merged:
        merged["rope_theta"] = cfg["rope_theta"]
    local = {"rope_theta": cfg["rope_local_base_freq"]} if "rope_local_base_freq" in cfg else None
    return merged, local


def _sliding(
    cfg: dict[str, Any], n_layers: int, max_position: int
) -> tuple[int | None, tuple[bool, ...]]:
    """The sliding window and which layers slide: ``layer_types`` where the config lists them,
    else every layer of a Mistral or Phi-3 with a window, else Qwen2's layers from
    ``max_window_layers`` on where ``use_sliding_window``. A window that covers the whole
    context slides nothing."""
    window = cfg.get("sliding_window")
    if not window or int(window) >= max_position:
        return None, ()
    types = cfg.get("layer_types")
    if types:
        sliding = tuple(t == "sliding_attention" for t in types)
    elif cfg.get("model_type") in ("mistral", "phi3") and cfg.get("use_sliding_window", True):
        sliding = (True,) * n_layers
    elif cfg.get("use_sliding_window"):
        first = int(cfg.get("max_window_layers", 0))
        sliding = tuple(i >= first for i in range(n_layers))
    else:
        return None, ()
    if len(sliding) != n_layers:
        raise ModelLoadError(f"layer_types lists {len(sliding)} layers of {n_layers}")
    return (int(window), sliding) if any(sliding) else (None, ())


def _rope_scaling(s: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling | None:
    kind = s.get("rope_type", s.get("type"))
    if kind in (None, "default"):
        return None
    if kind in ("longrope", "su"):  # Phi-3 (su: its first name)
        original = int(
            s.get("original_max_position_embeddings")
            or cfg.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings", 4096)
        )
        factor = float(
            s.get("factor") or int(cfg.get("max_position_embeddings", original)) / original
        )
        attention = s.get("attention_factor")
        if attention is None:
            attention = (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            )
        return RopeScaling(
            "longrope",
            factor,
            original_max_position=original,
            # float32, as transformers holds them (and GGUF stores them)
            short_factor=tuple(float(np.float32(v)) for v in s["short_factor"]),
            long_factor=tuple(float(np.float32(v)) for v in s["long_factor"]),
            attention_factor=float(attention),
        )
    if kind == "linear":
        return RopeScaling("linear", float(s["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(s["factor"]),
            low_freq_factor=float(s["low_freq_factor"]),
            high_freq_factor=float(s["high_freq_factor"]),
            original_max_position=int(s["original_max_position_embeddings"]),
        )
    raise ModelLoadError(f"rope scaling {kind!r} is not supported (llama3, linear, longrope)")


def safetensor_files(root: Path) -> list[SafetensorsFile]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{root} has no *.safetensors weights")
    return [SafetensorsFile(path) for path in files]


def tensor_names(files: list[SafetensorsFile]) -> list[str]:
    """The language model's tensors' names (text_name)."""
    names = (text_name(name) for f in files for name in f.keys())  # noqa: SIM118 (not a dict)
    return [n for n in names if n is not None]


def iter_tensors(
    files: list[SafetensorsFile], dense_dtype: str | None = None, arch: str = ""
) -> Iterator[NamedTensor]:
    """Every tensor of every file: in ``dense_dtype`` where given (weight_arrays.converted),
    read-only views of the mapped files where that is their own. A Gemma's norm weights come
    as ``1 + w`` in float32, what its norms multiply by (and what llama.cpp's GGUFs store)."""
    for f in files:
        for stored in f.keys():  # noqa: SIM118 (not a dict)
            name = text_name(stored)
            if name is None:
                continue
            value = converted(f.get(stored), dense_dtype)
            if arch in GEMMA and name.endswith("norm.weight"):
                value = widened(value).astype(np.float32) + np.float32(1.0)
            yield NamedTensor(name, value, f.dtype_name(stored))


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def tokenizer_from_dir(root: Path, cfg: dict[str, Any]) -> Tokenizer:
    if not (root / "tokenizer.json").is_file():
        raise ModelLoadError(f"{root} has no tokenizer.json")
    tok_cfg = (
        read_json(root / "tokenizer_config.json")
        if (root / "tokenizer_config.json").is_file()
        else {}
    )
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if (root / "chat_template.jinja").is_file():  # transformers' newer, separate file wins
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    extra = _ids(cfg.get("eos_token_id"))
    if (root / "generation_config.json").is_file():
        extra += _ids(read_json(root / "generation_config.json").get("eos_token_id"))
    special = {
        k: _token(tok_cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    try:
        return Tokenizer.from_file(
            str(root / "tokenizer.json"),
            special=special,
            extra_eos_ids=extra,
            chat_template=template,
        )
    except Exception as e:  # tokenizers raises bare Exceptions on a bad file
        raise ModelLoadError(f"cannot read {root / 'tokenizer.json'}: {e}") from e
