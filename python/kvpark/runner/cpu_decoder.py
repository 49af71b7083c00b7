"""The Rust decoder (``_core._CpuDecoder``, rust/cpu_ops/src/decoder) built from numpy arrays,
and one step's rows (step_rows.py) handed to it: the CPU's one stack (lean_runner.py).

The decoder holds raw addresses: every array handed to it must stay alive, contiguous and
unmoved for the decoder's life; ``DecoderInputs.keep`` holds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

import kvpark._core as _core
from kvpark.model.arch import ModelArch
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.weight_arrays import Stacked
from kvpark.runner.step_rows import plan_rows
from kvpark.sched.plan import StepPlan

if TYPE_CHECKING:
    from kvpark._core import _DecoderFeatures, _LayerSpec, _Matrix

Array = npt.NDArray[np.generic]
DenseKind = Literal["f32", "f16", "bf16"]
# each dense kind: the numpy dtype that holds its values, and the decoder's kind letter
_DENSE: dict[str, tuple[type[np.generic], str]] = {
    "f32": (np.float32, "f"),
    "f16": (np.float16, "h"),
    "bf16": (np.uint16, "b"),
}
# each block kind (gguf_blocks.Blocks): its quants' numpy dtype, and the decoder's kind letter
# (q6, Q6_K's int8 with a scale per 16, has no offset: its address goes as 0)
_BLOCKS: dict[str, tuple[type[np.generic], str]] = {
    "q4": (np.uint8, "4"),
    "q4p": (np.uint8, "p"),
    "q8": (np.int8, "8"),
    "q6": (np.int8, "6"),
    "q6p": (np.uint8, "P"),  # compact: six bits a quant, int8 scales
    "q5p": (np.uint8, "Q"),  # Q5_K's q8 compact: five bits a quant, int8 scales and offsets
    "q5b": (np.uint8, "B"),  # Q5_0's and Q5_1's q8 compact: five bits, a scale (offset) a block
    "iq4": (np.uint8, "i"),
}


@dataclass(frozen=True)
class Dense:
    """A dense matrix ``[out, in]`` for the decoder (a safetensors or F32/F16/BF16 GGUF tensor):
    ``kind`` "f32" (float32 values), "f16" (float16) or "bf16" (its bits as uint16, the upper
    half of each float32's). Its products take float32 activations whatever the block dot."""

    data: Array
    kind: DenseKind

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.data.shape
        return n, k


Matrix = Blocks | Dense
# a fused matrix as the decoder takes it: one matrix, or its parts of different kinds in row order
Fused = Matrix | tuple[Matrix, ...]
# a dense array's dtype -> its kind (numpy_weights' arrays: bfloat16 as its uint16 bits)
_KIND_OF: dict[type[np.generic], DenseKind] = {
    np.float32: "f32",
    np.float16: "f16",
    np.uint16: "bf16",
}


def decoder_matrix(m: Blocks | Stacked | Array) -> Fused:
    """A matrix of the model's weights (numpy_weights.py) as the decoder takes it: blocks as they
    are, a dense array as ``Dense`` of its kind, in its own dtype (a bf16 checkpoint stays 16
    bits), a Stacked one as its parts so. A view the file's mapping left unaligned (safetensors
    packs tensors by bytes) is copied to an aligned one: the decoder reads its values as typed
    slices. ValueError for any other array (numpy_weights.decoder_unfit refuses those first)."""
    if isinstance(m, Stacked):
        return tuple(one_matrix(p) for p in m.parts)
    return one_matrix(m)


def single(w: Fused) -> Matrix:
    """A matrix that is one tensor of the file (O, down): never in parts."""
    if isinstance(w, tuple):
        raise ValueError("an unfused matrix in parts")
    return w


def one_matrix(m: Blocks | Array) -> Matrix:
    if isinstance(m, Blocks):
        return m
    kind = _KIND_OF.get(m.dtype.type)
    if kind is None or m.ndim != 2:
        raise ValueError(f"the decoder takes f32, f16 or bf16 matrices, not {m.dtype} {m.shape}")
    return Dense(np.require(m, requirements=["C", "A"]), kind)


@dataclass
class DecoderLayer:
    """One layer's arrays: vectors float32 (None where the model has none), K/V cells."""

    attn_norm: Array
    qkv: Fused
    o: Matrix
    mlp_norm: Array
    gate_up: Fused | None  # a dense MLP's; None in a mixture of experts' layer
    down: Matrix | None
    k_cells: Array
    v_cells: Array
    qkv_bias: Array | None = None
    o_bias: Array | None = None
    q_norm: Array | None = None
    k_norm: Array | None = None
    post_attn_norm: Array | None = None
    post_mlp_norm: Array | None = None
    router: Matrix | None = None  # a mixture of experts': the router, each expert's matrices
    experts: list[tuple[Fused, Matrix]] = field(default_factory=list)


@dataclass
class DecoderInputs:
    keep: list[Array] = field(default_factory=list)  # every array whose address the decoder holds

    def addr(self, a: Array | None, dtype: type[np.generic] = np.float32) -> int:
        """The address of a live, C-contiguous array of ``dtype`` (0 for None)."""
        if a is None:
            return 0
        if a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"the decoder takes C-contiguous {np.dtype(dtype)}, not {a.dtype}")
        self.keep.append(a)
        return int(a.ctypes.data)

    def parts(self, w: Fused) -> list[_Matrix]:
        """A fused matrix as the decoder takes it: its parts (one, where it is of one kind)."""
        return [self.matrix(p) for p in (w if isinstance(w, tuple) else (w,))]

    def matrix(self, w: Matrix) -> _Matrix:
        """A matrix as the decoder takes it: blocks by their arrays, a dense one by its values."""
        if isinstance(w, Dense):
            dtype, letter = _DENSE[w.kind]
            if w.data.ndim != 2:
                raise ValueError(f"a dense matrix is 2-D, not {w.data.shape}")
            n, k = w.shape
            return {
                "kind": letter,
                "qs": self.addr(w.data, dtype),
                "scale": 0,
                "offset": 0,
                "n": n,
                "k": k,
            }
        n, k = w.shape
        dtype, letter = _BLOCKS[w.kind]
        return {
            "kind": letter,
            "qs": self.addr(w.qs, dtype),
            "scale": self.addr(w.scale),
            "offset": self.addr(w.offset),
            "n": n,
            "k": k,
        }


def build_decoder(
    arch: ModelArch,
    layers: list[DecoderLayer],
    embed: Matrix,
    norm: Array,
    head: Matrix,
    ropes: Sequence[tuple[Array, Array]],
    pool_dtype: str,
    dot: str,
    inputs: DecoderInputs,
) -> _core._CpuDecoder:
    """``ropes``: the arch's rope tables (rope_angles.rope_tables); ``pool_dtype``: the cells'
    type (float32, bfloat16, float16); ``dot``: the decoder's arithmetic (``CpuPaths.decoder_dot``:
    int8, int8+bf16 or float32). The sliding layers' K/V arrays
    may be smaller than the global layers' (a window space of their own, numpy_pool.py)."""
    cell = layers[0].k_cells.dtype.type
    specs: list[_LayerSpec] = [
        {
            "attn_norm": inputs.addr(layer.attn_norm),
            "qkv": inputs.parts(layer.qkv),
            "qkv_bias": inputs.addr(layer.qkv_bias),
            "q_norm": inputs.addr(layer.q_norm),
            "k_norm": inputs.addr(layer.k_norm),
            "o": inputs.matrix(layer.o),
            "o_bias": inputs.addr(layer.o_bias),
            "mlp_norm": inputs.addr(layer.mlp_norm),
            "gate_up": [] if layer.gate_up is None else inputs.parts(layer.gate_up),
            "down": None if layer.down is None else inputs.matrix(layer.down),
            "router": None if layer.router is None else inputs.matrix(layer.router),
            "experts": [
                {"gate_up": inputs.parts(gate_up), "down": inputs.matrix(down)}
                for gate_up, down in layer.experts
            ],
            "top_k": arch.experts_per_token,
            "norm_topk": arch.norm_topk,
            "k_cells": inputs.addr(layer.k_cells, cell),
            "v_cells": inputs.addr(layer.v_cells, cell),
            "post_attn_norm": inputs.addr(layer.post_attn_norm),
            "post_mlp_norm": inputs.addr(layer.post_mlp_norm),
            "sliding": arch.window_of(i) is not None,
            "rope": arch.rope_table_of(i),
        }
        for i, layer in enumerate(layers)
    ]
    sizes = {arch.window_of(i) is not None: layer.k_cells.size for i, layer in enumerate(layers)}
    kv_values = sizes.get(False, layers[0].k_cells.size)
    window_kv_values = sizes.get(True, kv_values)
    a = arch
    shape = (a.hidden_size, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size)
    features: _DecoderFeatures = {
        "act": "g" if a.activation == "gelu_tanh" else "s",
        "embed_scale": a.embed_scale,
        "attn_scale": a.attention_scale,
        "attn_softcap": a.attn_softcap or 0.0,
        "final_softcap": a.final_softcap or 0.0,
        "window": a.sliding_window if any(a.sliding_layers) and a.sliding_window else 0,
    }
    return _core._CpuDecoder(
        (*shape, a.vocab_size),
        a.rms_eps,
        inputs.matrix(embed),
        inputs.addr(norm),
        inputs.matrix(head),
        [(inputs.addr(cos), inputs.addr(sin)) for cos, sin in ropes],
        ropes[0][0].size,
        specs,
        kv_values,
        pool_dtype,
        dot,
        features,
        window_kv_values,
    )


def run_step(
    decoder: _core._CpuDecoder, plan: StepPlan, page_size: int, logits: npt.NDArray[np.float32]
) -> None:
    """One step's rows through the decoder; ``logits`` [sampled rows, vocab] float32 gets the
    sampled rows' logits (page copies are the caller's, before)."""
    rows = plan_rows(plan)
    if logits.shape[0] != len(rows.sample_rows) or not logits.flags.c_contiguous:
        raise ValueError(f"logits {logits.shape} for {len(rows.sample_rows)} sampled rows")
    decoder.step(
        rows.tokens,
        rows.positions,
        plan.slot_mapping,
        rows.item_rows,
        plan.page_tables,
        page_size,
        rows.sample_rows,
        int(logits.ctypes.data),
        plan.window_slot_mapping or [],
        plan.window_page_tables or [],
    )


def run_hidden(
    decoder: _core._CpuDecoder, plan: StepPlan, page_size: int, out: npt.NDArray[np.float32]
) -> None:
    """One step's rows through the decoder up to the final norm: ``out`` [rows, hidden] float32
    gets every row's normed hidden state (``/v1/embeddings``), in row order."""
    rows = plan_rows(plan)
    if out.shape[0] != len(rows.tokens) or not out.flags.c_contiguous:
        raise ValueError(f"out {out.shape} for {len(rows.tokens)} rows")
    decoder.hidden(
        rows.tokens,
        rows.positions,
        plan.slot_mapping,
        rows.item_rows,
        plan.page_tables,
        page_size,
        list(range(len(rows.tokens))),
        int(out.ctypes.data),
        plan.window_slot_mapping or [],
        plan.window_page_tables or [],
    )
