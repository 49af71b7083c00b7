"""The model layer: load a checkpoint (GGUF or Hugging Face) into a paged-attention Llama."""

from __future__ import annotations

from kvpark.model.arch import ModelArch, ModelLoadError, RopeScaling
from kvpark.model.detokenizer import IncrementalDetokenizer
from kvpark.model.llama import LlamaModel
from kvpark.model.loader import LoadedModel, default_model_path, load_model, load_tokenizer
from kvpark.model.tokenizer import Tokenizer

__all__ = [
    "IncrementalDetokenizer",
    "LlamaModel",
    "LoadedModel",
    "ModelArch",
    "ModelLoadError",
    "RopeScaling",
    "Tokenizer",
    "default_model_path",
    "load_model",
    "load_tokenizer",
]
