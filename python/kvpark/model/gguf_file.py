"""A GGUF file's header, parsed over a memory map: metadata, architecture, tensor directory and
each tensor's bytes, with no torch (the CPU server loads its weights without it,
runner/lean_runner.py; model/gguf_tensors.py turns the bytes into numpy arrays).

The header is parsed here with ``struct`` rather than ``gguf.GGUFReader``: the reader builds a numpy
view per token and per merge (98k of them for SmolLM2), which took 2-6 s of a load; this parser
takes about 0.1 s.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvpark.model.arch import ModelLoadError

_MAGIC = b"GGUF"
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous (input) dimension
    qtype: int
    offset: int  # from the start of the data section


class GgufFile:
    """A parsed GGUF header over a memory-mapped file; ``metadata`` holds plain Python values."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            if f.read(4) != _MAGIC:
                raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic number)")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.path = path
        try:
            self._parse()
        except (
            struct.error,
            UnicodeDecodeError,
            IndexError,
            KeyError,
            ValueError,
            OverflowError,
        ) as e:
            raise ModelLoadError(f"{path}: corrupt GGUF header ({e})") from e

    def _parse(self) -> None:
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._mm, 4)
        if version < 2:
            raise ModelLoadError(f"{self.path}: GGUF version {version} is too old (need 2 or 3)")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._u32())
        self.tensors: list[TensorInfo] = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u32()
            shape = struct.unpack_from(f"<{n_dims}Q", self._mm, self._pos)
            self._pos += 8 * n_dims
            qtype, offset = struct.unpack_from("<IQ", self._mm, self._pos)
            self._pos += 12
            self.tensors.append(TensorInfo(name, tuple(shape), qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        self._data_start = (self._pos + align - 1) // align * align

    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._mm, self._pos)
        self._pos += 4
        return int(v)

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._mm, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return self._mm[start : start + n].decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype = self._u32()
            (n,) = struct.unpack_from("<Q", self._mm, self._pos)
            self._pos += 8
            if etype in _SCALARS:  # numbers in one numpy read
                dtype = np.dtype(_SCALARS[etype].replace("?", "b1"))
                arr = np.frombuffer(self._mm, dtype=dtype, count=n, offset=self._pos)
                self._pos += n * dtype.itemsize
                return arr.tolist()
            return [self._value(etype) for _ in range(n)]
        fmt = _SCALARS[vtype]
        (v,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def has_tensor(self, name: str) -> bool:
        return any(t.name == name for t in self.tensors)

    def raw(self, info: TensorInfo) -> tuple[GGMLQuantizationType, np.ndarray]:
        """A tensor's type and bytes, a read-only view of the file."""
        try:
            qtype = GGMLQuantizationType(info.qtype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{info.name}: unknown GGML type {info.qtype}") from e
        n_bytes = prod(info.shape) // block * type_size
        try:
            raw = np.frombuffer(self._mm, np.uint8, n_bytes, self._data_start + info.offset)
        except ValueError as e:
            raise ModelLoadError(
                f"{self.path}: tensor {info.name} lies past the end of the file"
            ) from e
        return qtype, raw

    def release(self, info: TensorInfo, n_bytes: int) -> None:
        """Drop a tensor's pages of the file from this process once its bytes are copied.

        Every page read through the mapping stays resident (and counts in the server's RSS)
        until the mapping is closed with this object; so the whole file (96 MB for the default
        model) sat beside the copies made from it at the peak. The file stays in the page
        cache, and a later read of these pages faults them back.
        """
        advise = getattr(self._mm, "madvise", None)
        dontneed = getattr(mmap, "MADV_DONTNEED", None)
        if advise is None or dontneed is None:  # not Linux: the mapping's close does it
            return
        start = self._data_start + info.offset
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        advise(dontneed, first, min(start + n_bytes, len(self._mm)) - first)


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
# read into ModelArch (Phi-3's LongRoPE), not weights
SKIPPED = ("rope_factors_long.weight", "rope_factors_short.weight")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# Gemma's names (its HF post_attention_layernorm norms the attention's output), Phi-3's fused
# gate/up in ffn_up
_ARCH_LAYER_NAMES = {
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """llama.cpp's tensor name -> the Hugging Face name the weights are assembled under."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _LAYER_NAMES | _ARCH_LAYER_NAMES.get(arch, {})
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")


def is_gguf(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _MAGIC
