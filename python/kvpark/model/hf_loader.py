"""Read a Hugging Face model directory: config.json, *.safetensors (into numpy, without torch:
safetensors_file.py), tokenizer.json and its config.

Both config spellings are understood: transformers 4's ``rope_theta`` / ``rope_scaling`` and
transformers 5's ``rope_parameters``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpark.model.arch import ModelArch, ModelLoadError, RopeScaling
from kvpark.model.safetensors_file import SafetensorsFile
from kvpark.model.weight_arrays import NamedTensor, converted
from kvpark.tokenizer.tokenizer import Tokenizer

# config.json model_type -> our variant. Mistral is a Llama (its sliding window is handled below).
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def variant(cfg: dict[str, Any]) -> str:
    """Our variant for a config.json, or a ModelLoadError naming the unsupported architecture."""
    model_type = cfg.get("model_type")
    arch = _MODEL_TYPES.get(str(model_type))
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture: model_type {model_type!r} "
            f"({cfg.get('architectures')}); supported: {', '.join(sorted(_MODEL_TYPES))}"
        )
    return arch


def arch_from_config(cfg: dict[str, Any], has_lm_head: bool) -> ModelArch:
    model_type = cfg.get("model_type")
    arch = variant(cfg)
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise ModelLoadError(f"only SiLU MLPs without bias are supported ({model_type})")
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    max_position = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window")
    sliding = cfg.get("use_sliding_window", model_type == "mistral") or (
        "sliding_attention" in (cfg.get("layer_types") or [])
    )
    if sliding and window:
        # Attention over at most `window` cells is full attention: cap the context there.
        max_position = min(max_position, int(window))
    hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelArch(
        arch=arch,
        n_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=max_position,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)) or not has_lm_head,
        qkv_bias=arch == "qwen2" or attention_bias,
        o_bias=arch != "qwen2" and attention_bias,
        qk_norm=arch == "qwen3",
        rope_scaling=_rope_scaling(scaling),
    )


def _rope_scaling(s: dict[str, Any] | None) -> RopeScaling | None:
    if not s:
        return None
    kind = s.get("rope_type", s.get("type"))
    if kind in (None, "default"):
        return None
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
    raise ModelLoadError(f"rope scaling {kind!r} is not supported (llama3, linear)")


def safetensor_files(root: Path) -> list[SafetensorsFile]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{root} has no *.safetensors weights")
    return [SafetensorsFile(path) for path in files]


def tensor_names(files: list[SafetensorsFile]) -> list[str]:
    return [name for f in files for name in f.keys()]  # noqa: SIM118 (not a dict)


def iter_tensors(
    files: list[SafetensorsFile], dense_dtype: str | None = None
) -> Iterator[NamedTensor]:
    """Every tensor of every file: in ``dense_dtype`` where given (weight_arrays.converted),
    read-only views of the mapped files where that is their own."""
    for f in files:
        for name in f.keys():  # noqa: SIM118 (not a dict)
            yield NamedTensor(name, converted(f.get(name), dense_dtype), f.dtype_name(name))


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
