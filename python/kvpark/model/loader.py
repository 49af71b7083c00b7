"""``load_model``: a GGUF file or a Hugging Face directory -> the torch model, tokenizer and
architecture. Where a model comes from (the default model's path, its tokenizer) is
model/sources.py, which needs no torch."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvpark.model import gguf_loader, hf_loader
from kvpark.model.arch import ModelArch, ModelLoadError
from kvpark.model.llama import LlamaModel
from kvpark.model.ops.block_weights import BlockWeight
from kvpark.model.sources import (
    DEFAULT_FILE,
    DEFAULT_PACKAGE,
    default_model_path,
    gguf_tokenizer,
    load_tokenizer,
    return_freed_heap,
)
from kvpark.tokenizer.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_FILE",
    "DEFAULT_PACKAGE",
    "LoadedModel",
    "default_model_path",
    "load_model",
    "load_tokenizer",
]


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

    ``blocks``: keep a GGUF's Q4_0, Q4_1, Q8_0, Q4_K and Q5_K matrices in blocks, multiplied by
    ``block_linear`` (CPU and float32 only; ``--weights``); other tensors load dense.
    """
    start = time.perf_counter()
    path = path or default_model_path()
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory without config.json")
        model, tokenizer, name = _load_hf(p, dtype, device, progress)
    elif gguf_loader.is_gguf(p):
        model, tokenizer, name = _load_gguf(path, dtype, device, progress, blocks)
    else:
        raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face model directory")
    model.eval()
    return_freed_heap()
    return LoadedModel(model, tokenizer, model.arch, name, time.perf_counter() - start)


def _fill(
    model: LlamaModel,
    weights: Iterable[tuple[str, torch.Tensor | BlockWeight]],
    total: int,
    progress: bool,
    what: str,
) -> None:
    bar: Iterator[tuple[str, torch.Tensor | BlockWeight]] = tqdm(
        weights,
        total=total,
        desc=f"loading {what}",
        unit="tensor",
        disable=not progress,
        leave=False,
    )
    for name, tensor in bar:
        model.load_weight(name, tensor)
    model.finish_loading()


def _load_gguf(
    path: str, dtype: torch.dtype, device: torch.device, progress: bool, blocks: bool
) -> tuple[LlamaModel, Tokenizer, str]:
    g = gguf_loader.GgufFile(path)
    arch = gguf_loader.arch_from_gguf(g)
    tokenizer = gguf_tokenizer(g.metadata)
    model = LlamaModel(arch, dtype, device)
    weights = gguf_loader.iter_weights(g, arch, blocks=blocks)
    _fill(model, weights, len(g.tensors), progress, Path(path).name)
    return model, tokenizer, Path(path).name


def _load_hf(
    root: Path, dtype: torch.dtype, device: torch.device, progress: bool
) -> tuple[LlamaModel, Tokenizer, str]:
    cfg = hf_loader.read_json(root / "config.json")
    hf_loader.variant(cfg)  # an unsupported architecture is the clearest error: check it first
    files = hf_loader.safetensor_files(root)
    names = hf_loader.tensor_names(files)
    arch = hf_loader.arch_from_config(cfg, has_lm_head="lm_head.weight" in names)
    tokenizer = hf_loader.tokenizer_from_dir(root, cfg)
    model = LlamaModel(arch, dtype, device)
    # A tied checkpoint may still carry a copy of the head; the embedding is what HF uses then.
    skip = {"lm_head.weight"} if arch.tie_embeddings else set()
    _fill(
        model,
        hf_loader.iter_weights(files, skip),
        len(names) - len(skip & set(names)),
        progress,
        root.name,
    )
    return model, tokenizer, root.name
