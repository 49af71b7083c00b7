"""A model's weights as numpy arrays, read once from its files (numpy_weights.py) for both the
torch model (torch_weights.py wraps them) and the Rust decoder of the lean CPU runner.

Under Hugging Face names, as the model holds them: Q and K rows unpermuted for Llama GGUFs, Q/K/V
and gate/up fused (weight_names.py), vectors widened to float32. A matrix is ``Blocks`` (a GGUF's
Q4_0, Q4_1, Q8_0, or Q4_K / Q5_K repacked; gguf_blocks.py, kquant_repack.py) or a dense array:
float32 or float16, or bfloat16 as its uint16 bits (numpy has no bfloat16; no checkpoint holds
uint16 weights, so the dtype says it).

A fused matrix whose parts differ in kind (a Q4_K_M file's Q4_K attn_q and attn_k beside its
Q6_K attn_v; F16 parts beside blocks) is ``Stacked``: the parts kept as they are, rows in order,
never one float32 copy; the decoder multiplies each part in its own kind, the torch model takes
their float32 values joined.

``NumpyWeights`` holds any of these. The Rust decoder of the lean runner multiplies them all:
blocks, and a dense matrix of values as the file stores them (F32, F16 or BF16; ``unfit_why``
names each matrix it cannot take and why, numpy_weights.decoder_unfit reports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic

import numpy as np
import numpy.typing as npt
from typing_extensions import TypeVar

from kvpark.model.arch import ModelArch
from kvpark.model.gguf_blocks import Blocks

F32 = npt.NDArray[np.float32]
Dense = npt.NDArray[Any]  # float32, float16, or uint16: bfloat16 bits
Single = Blocks | Dense  # one tensor of a file, as a reader gives it


@dataclass(frozen=True)
class Stacked:
    """A fused matrix of parts of more than one kind: ``parts``' rows in order."""

    parts: tuple[Single, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(int(p.shape[0]) for p in self.parts), int(self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)

    def dequantize(self) -> F32:
        """Every part's values in float32 (each exactly: dequantised blocks, widened floats),
        joined: what the torch model multiplies."""
        out: F32 = np.concatenate(
            [
                p.dequantize() if isinstance(p, Blocks) else widened(p).astype(np.float32)
                for p in self.parts
            ]
        )
        return out


Matrix = Blocks | Dense | Stacked
M = TypeVar("M", bound=Matrix, default=Matrix)
# the file formats (GGML type names, safetensors dtypes) the decoder multiplies as they are
DENSE_FORMATS = ("F32", "F16", "BF16")
# the arrays they are read into (BF16 as its bits)
DENSE_ARRAYS: tuple[type[np.generic], ...] = (np.float32, np.float16, np.uint16)


@dataclass(frozen=True)
class NamedTensor:
    """One tensor as a reader gives it: its Hugging Face name, its values (Q/K rows already
    unpermuted) and its format in the file (a GGML type name, or a safetensors dtype)."""

    name: str
    value: Single
    fmt: str


@dataclass
class NumpyLayer(Generic[M]):
    """One layer: its vectors (float32) and its matrices, fused."""

    vectors: dict[str, F32] = field(default_factory=dict)  # attn_norm, qkv_b, o_b, q_norm, ...
    matrices: dict[str, M] = field(default_factory=dict)  # qkv_w, o_w, gate_up_w, down_w


@dataclass
class NumpyWeights(Generic[M]):
    arch: ModelArch
    layers: list[NumpyLayer[M]]
    embed: M  # the token embedding (looked up from its blocks, where blocks)
    head: M  # the output matrix; the embedding itself when tied
    norm: F32
    rope_freqs: F32 | None  # a GGUF's llama3 rope scaling (per-frequency divisors), if any
    # why the decoder cannot multiply a matrix, for each it cannot: "layer 0's qkv_w", "the
    # embedding", "the head" -> the tensor and its format, or the fused parts' kinds
    unfit_why: dict[str, str] = field(default_factory=dict)

    def matrix_parts(self) -> list[Single]:
        """Every matrix's tensors (a fused matrix's parts), the embedding's and a head's own."""
        matrices: list[Matrix] = [m for layer in self.layers for m in layer.matrices.values()]
        matrices += [self.embed] + ([] if self.head is self.embed else [self.head])
        return [p for m in matrices for p in (m.parts if isinstance(m, Stacked) else (m,))]

    @property
    def nbytes(self) -> int:
        arrays: list[Matrix] = [m for layer in self.layers for m in layer.matrices.values()]
        arrays += [v for layer in self.layers for v in layer.vectors.values()]
        arrays += [self.embed] + ([] if self.head is self.embed else [self.head])
        return sum(a.nbytes for a in arrays) + self.norm.nbytes


class Unfit(Exception):
    """The file holds something the decoder's weights cannot (the message says what)."""


def widened(a: Dense) -> Dense:
    """A dense array as float32 where it is bfloat16 bits (exact), else as it is."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a


DENSE_DTYPES = ("float32", "float16", "bfloat16")


def converted(a: Dense, dtype: str | None) -> Dense:
    """A dense array in the model's ``dtype`` (one of DENSE_DTYPES; None: as it is), rounded as
    torch rounds a copy into a parameter of that dtype: to nearest, ties to even, by way of
    float32 (which holds float16 and bfloat16 values exactly). So a reader can store each tensor
    at the model's size as it goes, rather than all of them in float32 first. Vectors stay as
    read: they are small, and the rope factors are no parameter (float64 arithmetic reads them)."""
    if (
        dtype is None
        or a.ndim < 2
        or a.dtype == {"float32": np.float32, "float16": np.float16}.get(dtype)
    ):
        return a
    if dtype == "bfloat16":
        if a.dtype == np.uint16:
            return a
        bits = a.astype(np.float32).view(np.uint32)
        rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
        out: Dense = np.where(np.isnan(a), np.uint16(0x7FC0), rounded)
        return out
    return widened(a).astype(np.float32 if dtype == "float32" else np.float16)
