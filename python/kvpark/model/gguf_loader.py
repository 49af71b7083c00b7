"""Read a GGUF file: metadata, architecture, and weights dequantised to torch under HF names.

The header is parsed here with ``struct`` rather than ``gguf.GGUFReader``: the reader builds a numpy
view per token and per merge (98k of them for SmolLM2), which took 2-6 s of a load; this parser
takes about 0.1 s. Q8_0, Q4_0 and Q4_1 are dequantised with torch (bitwise as ``gguf.quants``, 5x
faster), other types (the K-quants among them) by ``gguf.quants``. Tensor data is memory-mapped
and dequantised one tensor at a time, so peak memory stays near the size of the loaded weights.

llama.cpp's converter permutes the rows of Q and K in Llama-family files for its interleaved rope;
``_unpermute`` undoes that so the model runs the NEOX rope of Hugging Face checkpoints.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kvpark.model.arch import SUPPORTED_ARCHS, ModelArch, ModelLoadError, RopeScaling
from kvpark.model.ops.block_weights import BLOCK_TYPES, BlockWeight, half_at, nibbles
from kvpark.model.ops.kquant_blocks import KQUANT_TYPES, kquant_from_gguf

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

    def _raw(self, info: TensorInfo) -> tuple[GGMLQuantizationType, np.ndarray]:
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

    def load_blocks(self, info: TensorInfo) -> BlockWeight | None:
        """A 2-D Q4_0, Q4_1 or Q8_0 tensor kept in its blocks, or a Q4_K or Q5_K one repacked into
        blocks of 32 (``--weights blocks``); None for any other tensor (Q6_K included: its scales
        per 16 weights have no exact 32-block form, docs/cpu-kernels.md)."""
        if len(info.shape) != 2:
            return None
        if info.qtype in BLOCK_TYPES:
            make = BlockWeight.from_gguf
        elif info.qtype in KQUANT_TYPES:
            make = kquant_from_gguf
        else:
            return None
        _, raw = self._raw(info)
        shape = (info.shape[1], info.shape[0])
        weight = make(info.qtype, torch.from_numpy(raw.copy()), shape)
        self._release(info, raw.nbytes)
        return weight

    def _release(self, info: TensorInfo, n_bytes: int) -> None:
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

    def load(self, info: TensorInfo) -> torch.Tensor:
        """One tensor dequantised, in torch layout (ggml shape reversed); float32, f16 or bf16."""
        qtype, raw = self._raw(info)
        tensor = self._dequantised(info, qtype, raw)
        self._release(info, raw.nbytes)
        return tensor

    def _dequantised(
        self, info: TensorInfo, qtype: GGMLQuantizationType, raw: np.ndarray
    ) -> torch.Tensor:
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(info.shape))
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = raw.view(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16)
            return torch.from_numpy(arr.copy()).view(shape)  # copy: the mmap is read-only
        if qtype == GGMLQuantizationType.BF16:
            return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).view(shape)
        if qtype in _TORCH_DEQUANT:  # same arithmetic as gguf.quants, several times faster
            blocks = torch.from_numpy(raw.copy()).view(-1, type_size)
            return _TORCH_DEQUANT[qtype](blocks).view(shape)
        rows = raw.reshape(-1, info.shape[0] // block * type_size)
        try:
            values = quants.dequantize(rows, qtype)
        except NotImplementedError as e:
            raise ModelLoadError(f"{info.name}: cannot dequantise {qtype.name}") from e
        return torch.from_numpy(values).view(shape)


_TORCH_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: lambda b: b[:, 2:].view(torch.int8).float() * half_at(b, 0),
    GGMLQuantizationType.Q4_0: lambda b: (nibbles(b[:, 2:]) - 8) * half_at(b, 0),
    GGMLQuantizationType.Q4_1: lambda b: half_at(b, 0) * nibbles(b[:, 4:]) + half_at(b, 2),
}


def arch_from_gguf(g: GgufFile) -> ModelArch:
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"{g.path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{g.path}: metadata lacks {arch}.{name}")
        if isinstance(value, list):
            raise ModelLoadError(f"{g.path}: per-layer {arch}.{name} is not supported")
        return value

    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    embed = next((t for t in g.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelLoadError(f"{g.path}: no token_embd.weight tensor")
    scaling = None
    scaling_type = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
    elif scaling_type not in ("none", None):
        raise ModelLoadError(f"{g.path}: rope scaling {scaling_type!r} is not supported")
    return ModelArch(
        arch=arch,
        n_layers=int(key("block_count")),
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=int(key("attention.key_length", hidden // n_heads)),
        intermediate_size=int(key("feed_forward_length")),
        vocab_size=embed.shape[1],
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position=int(key("context_length")),
        tie_embeddings=not g.has_tensor("output.weight"),
        qkv_bias=g.has_tensor("blk.0.attn_q.bias"),
        o_bias=g.has_tensor("blk.0.attn_output.bias"),
        qk_norm=g.has_tensor("blk.0.attn_q_norm.weight"),
        rope_scaling=scaling,
    )


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    """llama.cpp's tensor name -> the Hugging Face name ``LlamaModel.load_weight`` takes."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: GGUF rows 2i, 2i+1 of a head are HF rows i, i+d/2."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def iter_weights(
    g: GgufFile, arch: ModelArch, *, blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor | BlockWeight]]:
    """(Hugging Face name, tensor) for every tensor of the file, Q/K unpermuted for Llama. With
    ``blocks``, Q4_0, Q4_1, Q8_0, Q4_K and Q5_K matrices come as ``BlockWeight`` instead of
    dequantised."""
    for info in g.tensors:
        name = hf_name(info.name)
        kept = g.load_blocks(info) if blocks else None
        tensor: torch.Tensor | BlockWeight = kept if kept is not None else g.load(info)
        heads = 0
        if arch.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = arch.n_heads
        elif arch.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = arch.n_kv_heads
        if heads and isinstance(tensor, BlockWeight):  # the same row permutation, on blocks
            rows = torch.arange(tensor.shape[0]).view(-1, 1)
            tensor = tensor.rows(_unpermute(rows, heads).view(-1))
        elif heads and isinstance(tensor, torch.Tensor):
            tensor = _unpermute(tensor, heads)
        yield name, tensor


def is_gguf(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _MAGIC
