"""The model layer: checkpoints (GGUF, Hugging Face) loaded into a paged-attention Llama, and the
numeric ops it runs (ops/). Imports tokenizer, config, the Rust core and kernels/; no runner."""

from __future__ import annotations

from kvpark.model.arch import ModelArch, ModelLoadError, RopeScaling
from kvpark.model.llama import LlamaModel
from kvpark.model.loader import LoadedModel, default_model_path, load_model, load_tokenizer

__all__ = [
    "LlamaModel",
    "LoadedModel",
    "ModelArch",
    "ModelLoadError",
    "RopeScaling",
    "default_model_path",
    "load_model",
    "load_tokenizer",
]
