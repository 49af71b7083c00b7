"""A GGUF file's weights as torch tensors under Hugging Face names: dequantised, or kept in their
blocks (``BlockWeight``); the header itself is parsed in model/gguf_file.py, without torch.

Q8_0, Q4_0 and Q4_1 are dequantised with torch (bitwise as ``gguf.quants``, 5x faster), other
types (the K-quants among them) by ``gguf.quants``. Tensor data is memory-mapped and dequantised
one tensor at a time, so peak memory stays near the size of the loaded weights.

llama.cpp's converter permutes the rows of Q and K in Llama-family files for its interleaved rope;
``_unpermute`` undoes that so the model runs the NEOX rope of Hugging Face checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kvpark.model import gguf_file
from kvpark.model.arch import ModelArch, ModelLoadError
from kvpark.model.gguf_file import TensorInfo, arch_from_gguf, hf_name, is_gguf
from kvpark.model.ops.block_weights import BLOCK_TYPES, BlockWeight, half_at, nibbles
from kvpark.model.ops.kquant_blocks import KQUANT_TYPES, kquant_from_gguf

__all__ = ["GgufFile", "TensorInfo", "arch_from_gguf", "hf_name", "is_gguf", "iter_weights"]


class GgufFile(gguf_file.GgufFile):
    """The parsed header (gguf_file.GgufFile) and its tensors read into torch."""

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
        _, raw = self.raw(info)
        shape = (info.shape[1], info.shape[0])
        weight = make(info.qtype, torch.from_numpy(raw.copy()), shape)
        self.release(info, raw.nbytes)
        return weight

    def load(self, info: TensorInfo) -> torch.Tensor:
        """One tensor dequantised, in torch layout (ggml shape reversed); float32, f16 or bf16."""
        qtype, raw = self.raw(info)
        tensor = self._dequantised(info, qtype, raw)
        self.release(info, raw.nbytes)
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
