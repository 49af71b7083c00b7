"""The model layer: checkpoints (GGUF, Hugging Face) loaded into a paged-attention Llama, and the
numeric ops it runs (ops/). Imports tokenizer, config, the Rust core and kernels/; no runner.

Loaded lazily, as ``kvpark`` itself is: ``kvpark.model.numpy_weights`` (say) must not import torch
through this file (the CPU server runs without it, runner/lean_runner.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpark.model.arch import ModelArch, ModelLoadError, RopeScaling
    from kvpark.model.llama import LlamaModel
    from kvpark.model.loader import LoadedModel, load_model
    from kvpark.model.sources import default_model_path, load_tokenizer

_EXPORTS = {
    "LlamaModel": "kvpark.model.llama",
    "LoadedModel": "kvpark.model.loader",
    "ModelArch": "kvpark.model.arch",
    "ModelLoadError": "kvpark.model.arch",
    "RopeScaling": "kvpark.model.arch",
    "default_model_path": "kvpark.model.sources",
    "load_model": "kvpark.model.loader",
    "load_tokenizer": "kvpark.model.sources",
}
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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvpark.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
