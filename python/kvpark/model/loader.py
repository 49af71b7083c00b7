"""``load_model``: a GGUF file or a Hugging Face directory -> the torch model, tokenizer and
architecture: the files read into numpy weights (numpy_weights.py, no torch), then the torch
model built over them (torch_weights.py). Where a model comes from (the default model's path,
its tokenizer) is model/sources.py."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvpark.model.arch import ModelArch
from kvpark.model.llama import LlamaModel
from kvpark.model.numpy_weights import read_model
from kvpark.model.sources import (
    DEFAULT_FILE,
    DEFAULT_PACKAGE,
    default_model_path,
    load_tokenizer,
    return_freed_heap,
)
from kvpark.model.torch_weights import torch_model
from kvpark.tokenizer.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_FILE",
    "DEFAULT_PACKAGE",
    "LoadedModel",
    "default_model_path",
    "load_model",
    "load_tokenizer",
]


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # weight_arrays.DENSE_DTYPES


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    arch: ModelArch
    name: str  # what /v1/models reports
    load_seconds: float


def load_model(
    path: str | None,
    dtype: torch.dtype,
    device: torch.device,
    *,
    progress: bool = True,
    blocks: bool = False,
) -> LoadedModel:
    """Load a GGUF file or a HF directory (config.json, *.safetensors, tokenizer.json).

    ``blocks``: keep a GGUF's Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and
    IQ4_XS matrices in blocks, multiplied by ``block_linear`` (CPU and float32 only; ``--weights``);
    other tensors load dense.
    """
    start = time.perf_counter()
    weights, tokenizer, name = read_model(
        path or default_model_path(),
        blocks=blocks and device.type == "cpu",
        progress=progress,
        dense_dtype=str(dtype).removeprefix("torch.") if dtype in _DTYPES else None,
    )
    model = torch_model(weights, dtype, device)
    del weights  # what the model does not share is freed here, before the heap is handed back
    model.eval()
    return_freed_heap()
    return LoadedModel(model, tokenizer, model.arch, name, time.perf_counter() - start)
