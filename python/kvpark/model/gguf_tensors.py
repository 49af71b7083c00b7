"""A GGUF file's tensors read into numpy under Hugging Face names, without torch; the header is
model/gguf_file.py's.

A 2-D Q4_0, Q4_1 or Q8_0 tensor can be kept in its blocks and a Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL or IQ4_XS one repacked into them (``blocks``; q5_blocks.py, kquant_repack.py,
iq4_blocks.py); every other tensor comes
dense: F32 and F16 as they are, BF16 as its uint16 bits, anything quantised dequantised to
float32 (Q8_0, Q4_0 and Q4_1 here, bitwise as ``gguf.quants`` and 5x faster; the rest, the
quantised types without ``blocks`` among them, by ``gguf.quants``). Tensor data is memory-mapped
and each tensor's pages are released once it is copied, so peak memory stays near the size of the
weights read.

llama.cpp's converter permutes the rows of Q and K in Llama-family files for its interleaved rope;
``iter_tensors`` undoes that (the one place that does) so the model runs the NEOX rope of Hugging
Face checkpoints.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kvpark.model.arch import ModelArch, ModelLoadError
from kvpark.model.gguf_blocks import (
    BLOCK_TYPES,
    Blocks,
    blocks_from_gguf,
    half_at,
    nibbles,
    unpermute_rows,
)
from kvpark.model.gguf_file import SKIPPED, GgufFile, TensorInfo, hf_name
from kvpark.model.iq4_blocks import IQ4_TYPES, iq4_blocks
from kvpark.model.kquant_repack import KQUANT_TYPES, kquant_blocks
from kvpark.model.q5_blocks import Q5_TYPES, q5_blocks
from kvpark.model.weight_arrays import Dense, NamedTensor, Single, converted

Q = GGMLQuantizationType
U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
# the GGML types a matrix can keep as blocks
KEPT_TYPES = BLOCK_TYPES + Q5_TYPES + KQUANT_TYPES + IQ4_TYPES


def iter_tensors(
    g: GgufFile, arch: ModelArch, *, blocks: bool = False, dense_dtype: str | None = None
) -> Iterator[NamedTensor]:
    """Every tensor of the file in file order, Q/K rows unpermuted for Llama; with ``blocks``,
    matrices of ``KEPT_TYPES`` as ``Blocks``; dense ones in ``dense_dtype`` where given
    (weight_arrays.converted)."""
    for info in g.tensors:
        if info.name in SKIPPED:
            continue
        if _EXPERTS.fullmatch(info.name):
            yield from expert_tensors(g, info, blocks=blocks, dense_dtype=dense_dtype)
            continue
        name = hf_name(info.name, arch.arch)
        value = read_tensor(g, info, blocks=blocks)
        if not isinstance(value, Blocks):
            value = converted(value, dense_dtype)
        heads = permuted_heads(arch, name)
        if heads:
            index = unpermute_rows(value.shape[0], heads)
            value = value.rows(index) if isinstance(value, Blocks) else value[index]
        yield NamedTensor(name, value, Q(info.qtype).name)


# a mixture of experts' matrices, all experts in one 3-D tensor [experts, out, in]
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def expert_tensors(
    g: GgufFile, info: TensorInfo, *, blocks: bool, dense_dtype: str | None
) -> Iterator[NamedTensor]:
    """A 3-D experts tensor as each expert's matrix, under Hugging Face's per-expert names:
    read as one [experts * out, in] matrix (its bytes are that), then cut by rows; each expert's
    matrix is a view of the one read (blocks keep their rows whole)."""
    m = _EXPERTS.fullmatch(info.name)
    assert m is not None and len(info.shape) == 3
    cols, rows, n = info.shape
    flat = read_tensor(
        g, TensorInfo(info.name, (cols, rows * n), info.qtype, info.offset), blocks=blocks
    )
    if not isinstance(flat, Blocks):
        flat = converted(flat, dense_dtype)
    layer, which = m.group(1), m.group(2)
    for e in range(n):
        part: Single
        if isinstance(flat, Blocks):
            offset = None if flat.offset is None else flat.offset[e * rows : (e + 1) * rows]
            part = Blocks(
                flat.kind,
                flat.qs[e * rows : (e + 1) * rows],
                flat.scale[e * rows : (e + 1) * rows],
                offset,
            )
        else:
            part = flat[e * rows : (e + 1) * rows]
        name = f"model.layers.{layer}.mlp.experts.{e}.{which}_proj.weight"
        yield NamedTensor(name, part, Q(info.qtype).name)


def permuted_heads(arch: ModelArch, name: str) -> int:
    """Heads whose rows llama.cpp permuted in this tensor (Q and K of Llama files), else 0."""
    if arch.arch != "llama":
        return 0
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return arch.n_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return arch.n_kv_heads
    return 0


def read_tensor(g: GgufFile, info: TensorInfo, *, blocks: bool = False) -> Single:
    """One tensor in torch layout (ggml's shape reversed), a fresh copy; its pages of the file
    are released after."""
    qtype, raw = g.raw(info)
    value: Single
    if blocks and len(info.shape) == 2 and qtype in KEPT_TYPES:
        shape = (info.shape[1], info.shape[0])
        make = (
            blocks_from_gguf
            if qtype in BLOCK_TYPES
            else q5_blocks
            if qtype in Q5_TYPES
            else iq4_blocks
            if qtype in IQ4_TYPES
            else kquant_blocks
        )
        value = make(qtype, raw, shape)
    else:
        value = dense(info, qtype, raw)
    g.release(info, raw.nbytes)
    return value


_FLOATS: dict[Q, type[np.generic]] = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16}


def dense(info: TensorInfo, qtype: Q, raw: U8) -> Dense:
    """A tensor's bytes as a dense array: floats as stored (BF16 as bits), others float32."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(reversed(info.shape))
    if qtype in _FLOATS:
        return raw.view(_FLOATS[qtype]).reshape(shape).copy()  # copy: the mmap is read-only
    if qtype in DEQUANT:
        return DEQUANT[qtype](raw.reshape(-1, type_size)).reshape(shape)
    rows = raw.reshape(-1, info.shape[0] // block * type_size)
    try:
        values: Dense = quants.dequantize(rows, qtype)
    except NotImplementedError as e:
        raise ModelLoadError(f"{info.name}: cannot dequantise {qtype.name}") from e
    return values.reshape(shape)


# blocks (uint8 [n, bytes]) -> float32 [n, 32]: gguf.quants' arithmetic, one array op at a time
DEQUANT: dict[Q, Callable[[U8], F32]] = {
    Q.Q8_0: lambda b: b[:, 2:].view(np.int8).astype(np.float32) * half_at(b, 0),
    Q.Q4_0: lambda b: (nibbles(b[:, 2:]) - 8) * half_at(b, 0),
    Q.Q4_1: lambda b: half_at(b, 0) * nibbles(b[:, 4:]) + half_at(b, 2),
}
