"""Matmuls with weights kept in a GGUF file's 32-weight blocks, on the CPU (``--weights blocks``).

A decode step reads every weight once, so on a CPU its time is the bytes it reads: the default
model's Q4_1 weights are 4.5 bits each, 32 once expanded to float32. ``BlockWeight`` keeps Q4_0,
Q4_1 and Q8_0 matrices as they are in the file (scales widened to float32), Q4_K and Q5_K repacked
into the same 32-weight kinds and Q6_K into its own, int8 with a scale per 16
(model/kquant_repack.py); ``block_linear`` multiplies them by float32 activations in Rust
(``rust/cpu_ops``: AVX2 and FMA where the CPU has them), expanding each block in registers. The
expanded weights are bitwise the dequantised ones, and a row's result does not depend on the other
rows of the step, so the op is row-invariant and exact mode uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import kvpark._core as _core
from kvpark.model.gguf_blocks import (
    BLOCK,
    BLOCK_TYPES,
    Q4_0,
    Q4_1,
    Q8_0,
    Blocks,
    blocks_from_gguf,
    scale_group,
)

__all__ = ["BLOCK", "BLOCK_TYPES", "Q4_0", "Q4_1", "Q8_0", "BlockWeight", "block_linear"]
Tensor = torch.Tensor


@dataclass(frozen=True)
class BlockWeight:
    """A weight matrix ``[out, in]`` in blocks of 32 along ``in``.

    ``kind`` "q4": ``qs`` [out, in / 2] uint8, GGUF's nibble order (weight i of a block in the low
    nibble of byte i, weight i + 16 in the high one); weight = scale * nibble + offset.
    ``kind`` "q8": ``qs`` [out, in] int8; weight = scale * q, or scale * q + offset where
    ``offset`` is given (Q5_K's sub-blocks; Q8_0 has None).
    ``scale`` and ``offset``: [out, in / 32] float32.
    ``kind`` "q6" (Q6_K): ``qs`` [out, in] int8, ``scale`` [out, in / 16] float32, no offset;
    weight = scale * q.
    ``dense``: the same matrix dequantised (bfloat16 or float32) for the prompt path's GEMM
    (``--prompt-path``, cpu_paths.py), or None.
    ``int8``: ``block_linear`` rounds the activations to int8 per block of 32 and multiplies
    them by the quants in integers (``--block-dot int8``, llama.cpp's arithmetic); False: float32
    activations times each block expanded to float32 (``--block-dot float32``).
    """

    kind: str
    qs: Tensor
    scale: Tensor
    offset: Tensor | None
    dense: Tensor | None = None
    int8: bool = False

    def __post_init__(self) -> None:
        _check(self)  # once here: block_linear hands the raw addresses to Rust on every call

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0], self.scale.shape[1] * scale_group(self.kind)

    @property
    def nbytes(self) -> int:
        parts = (self.qs, self.scale) + ((self.offset,) if self.offset is not None else ())
        return sum(t.numel() * t.element_size() for t in parts)

    @staticmethod
    def from_gguf(qtype: int, raw: Tensor, shape: tuple[int, int]) -> BlockWeight:
        """From a GGUF tensor's bytes (uint8, blocks in file order) and its torch shape; the
        layout is read by gguf_blocks.blocks_from_gguf, the one place that knows it."""
        return BlockWeight.from_blocks(blocks_from_gguf(qtype, raw.numpy(), shape))

    @staticmethod
    def from_blocks(b: Blocks) -> BlockWeight:
        """numpy ``Blocks`` as torch tensors over the same memory (an "iq4" matrix as the "q8"
        blocks it equals: the torch path's kernels take those)."""
        if b.kind == "iq4":
            b = b.as_q8()
        offset = None if b.offset is None else torch.from_numpy(b.offset)
        return BlockWeight(b.kind, torch.from_numpy(b.qs), torch.from_numpy(b.scale), offset)

    def dequantize(self) -> Tensor:
        """The float32 matrix, bitwise what the GGUF loader's dequantisation gives."""
        out, inp = self.shape
        scale = self.scale.reshape(-1, 1)
        if self.kind in ("q8", "q6"):
            q = self.qs.view(-1, scale_group(self.kind)).float()
            if self.offset is None:
                return (q * scale).view(out, inp)
        else:
            q = nibbles(self.qs.view(-1, BLOCK // 2))
        assert self.offset is not None
        return (scale * q + self.offset.reshape(-1, 1)).view(out, inp)

    def with_dense(self, dtype: torch.dtype) -> BlockWeight:
        """This matrix with a dense copy in ``dtype`` for prompt chunks."""
        return replace(self, dense=self.dequantize().to(dtype).contiguous())

    def rows(self, index: Tensor) -> BlockWeight:
        """The matrix with its rows reordered (or selected) by ``index``."""
        offset = self.offset[index] if self.offset is not None else None
        return BlockWeight(self.kind, self.qs[index], self.scale[index], offset, int8=self.int8)

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Rows of several matrices of one kind, in order (a fused Q/K/V or gate/up matrix), by
        ``Blocks.cat``: q8 parts with and without offsets (Q5_K beside Q8_0) fuse with offsets
        throughout, -0.0 for a part without, which leaves every weight's bits as they were
        (x + -0.0 is x for every float x, +0.0 included; a +0.0 offset would turn a -0.0 weight
        into +0.0)."""
        return BlockWeight.from_blocks(Blocks.cat([p.blocks() for p in parts]))

    def blocks(self) -> Blocks:
        """These tensors as numpy ``Blocks`` over the same memory (the CPU ones they are)."""
        offset = None if self.offset is None else self.offset.numpy()
        return Blocks(self.kind, self.qs.numpy(), self.scale.numpy(), offset)


# GGUF's 32-weight blocks (gguf_blocks.py): the dequantisation's torch side
def nibbles(qs: Tensor) -> Tensor:
    """4-bit quants (uint8 [n, 16]) as float32 [n, 32], in weight order."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).float()


def set_threads(n: int) -> None:
    """Threads for the CPU kernels: block matmuls and decode attention (torch's are separate)."""
    _core._cpu_set_threads(n)


def block_linear(x: Tensor, w: BlockWeight, bias: Tensor | None = None) -> Tensor:
    """x [rows, in] float32 @ W.T (+ bias) -> [rows, out] float32, on the CPU."""
    out, inp = w.shape
    if x.dim() != 2 or x.shape[1] != inp:
        raise ValueError(f"x of shape {tuple(x.shape)} does not match a {w.shape} weight")
    if x.device.type != "cpu" or x.dtype != torch.float32:
        raise ValueError(f"block weights take float32 CPU activations, not {x.dtype} {x.device}")
    x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, out, dtype=torch.float32)
    if rows:
        if w.kind == "q4":
            assert w.offset is not None
            (_core._blockmm_q4_i8 if w.int8 else _core._blockmm_q4)(
                x.data_ptr(),
                rows,
                inp,
                w.qs.data_ptr(),
                w.scale.data_ptr(),
                w.offset.data_ptr(),
                out,
                y.data_ptr(),
            )
        elif w.kind == "q6":
            (_core._blockmm_q6_i8 if w.int8 else _core._blockmm_q6)(
                x.data_ptr(), rows, inp, w.qs.data_ptr(), w.scale.data_ptr(), out, y.data_ptr()
            )
        else:
            (_core._blockmm_q8_i8 if w.int8 else _core._blockmm_q8)(
                x.data_ptr(),
                rows,
                inp,
                w.qs.data_ptr(),
                w.scale.data_ptr(),
                w.offset.data_ptr() if w.offset is not None else 0,
                out,
                y.data_ptr(),
            )
    return y if bias is None else y.add_(bias)


def _check(w: BlockWeight) -> None:
    """The Rust side reads raw memory: every tensor must be what the sizes say, on the CPU."""
    if w.dense is not None and tuple(w.dense.shape) != w.shape:
        raise ValueError(f"dense copy {tuple(w.dense.shape)} of a {w.shape} block weight")
    if w.kind not in ("q4", "q8", "q6"):
        raise ValueError(f"unknown block kind {w.kind!r}")
    group = scale_group(w.kind)
    if w.scale.dim() != 2:
        raise ValueError(f"block scales must be [out, in / {group}], not {tuple(w.scale.shape)}")
    out, inp = w.shape
    if inp % BLOCK:
        raise ValueError(f"a {w.shape} block weight does not split into blocks of {BLOCK}")
    qs_dtype, qs_cols = (torch.uint8, inp // 2) if w.kind == "q4" else (torch.int8, inp)
    want = [(w.qs, qs_dtype, (out, qs_cols)), (w.scale, torch.float32, (out, inp // group))]
    if w.kind == "q4" and w.offset is None:
        raise ValueError("a q4 block weight needs offsets")
    if w.kind == "q6" and w.offset is not None:
        raise ValueError("a q6 block weight has no offsets")
    if w.offset is not None:  # q4 always, q8 optionally
        want.append((w.offset, torch.float32, (out, inp // BLOCK)))
    for t, dtype, shape in want:
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            got = f"{t.dtype} {tuple(t.shape)}"
            raise ValueError(f"block weight tensor {got}: want contiguous {dtype} {shape}")
        if t.device.type != "cpu":
            raise ValueError("block weights live on the CPU")
