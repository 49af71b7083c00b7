"""The GGUF header's names under their former module (tests/tokenizer imports ``GgufFile`` from
here); the header is model/gguf_file.py, the tensors model/gguf_tensors.py."""

from __future__ import annotations

from kvpark.model.gguf_arch import arch_from_gguf
from kvpark.model.gguf_file import GgufFile, TensorInfo, hf_name, is_gguf

__all__ = ["GgufFile", "TensorInfo", "arch_from_gguf", "hf_name", "is_gguf"]
