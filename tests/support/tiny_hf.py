"""Tiny random Hugging Face checkpoints of each architecture variant the loaders take, saved by
transformers with the default model's tokenizer: the loader tests compare them logit for logit,
the runner tests serve them (lean and torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpark.tokenizer.tokenizer import Tokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)
COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=49152,
    max_position_embeddings=512,
)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2 (qkv bias, tied)": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3 (qk norm, head_dim 32)": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "llama3 rope scaling": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
}


def save_tiny(kind: str, tokenizer: Tokenizer, root: Path, **overrides: Any) -> Any:
    """The variant ``kind`` (``overrides`` replace its config's fields) saved in ``root``."""
    transformers = pytest.importorskip("transformers")
    config_class, extra = VARIANTS[kind]
    config = getattr(transformers, config_class)(**(COMMON | extra | overrides))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random everything, biases and norms included, so each one matters
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.08)
    model.save_pretrained(str(root))
    tokenizer.backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": TEMPLATE})
    )
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return model
