"""``NumpyWeights`` (numpy_weights.py) as the torch model: every array wrapped with
``torch.from_numpy``, without a copy where the model's dtype and device are the array's (a fresh
float32 array on the CPU), copied into the parameter otherwise (another dtype, CUDA, or a read-only
view of a safetensors file). ``Blocks`` become ``BlockWeight`` over the same memory, on the CPU;
on another device they are dequantised (the block kernels are the CPU's)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from kvpark.model.arch import ModelArch, ModelLoadError
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.llama import Block, LlamaModel
from kvpark.model.ops.block_weights import BlockWeight
from kvpark.model.ops.rope import RopeTable
from kvpark.model.weight_arrays import Dense, Matrix, NumpyWeights, Stacked


def torch_model(
    w: NumpyWeights[Matrix],
    dtype: torch.dtype,
    device: torch.device,
    make: Callable[[ModelArch, torch.dtype, torch.device], LlamaModel] = LlamaModel,
) -> LlamaModel:
    """The model over ``w``'s arrays (which it then shares: do not write to them); ``make``
    builds the empty model (a tensor-parallel rank's shard: model/tp_model.py)."""
    arch = w.arch
    model = make(arch, dtype, device)
    for i, (layer, module) in enumerate(zip(w.layers, model.layers, strict=True)):
        for attr, vector in layer.vectors.items():
            _put(getattr(module, attr), vector, f"layer {i}'s {attr}")
        for attr, matrix in layer.matrices.items():
            assert isinstance(module, Block)
            owner, name = _slot(module, attr)
            _put_matrix(owner, name, matrix, device, f"layer {i}'s {attr}")
    _put(model.norm, w.norm, "the output norm")
    if w.rope_freqs is not None:  # a GGUF's llama3 rope scaling, as per-frequency divisors
        model.ropes = RopeTable.build_all(arch, w.rope_freqs, device)
    if isinstance(w.embed, Blocks) and device.type == "cpu":
        # rows are dequantised where they are looked up, bitwise the dense matrix's, and the
        # dense matrix is never built (113 MB for the default model)
        model.embed_blocks = BlockWeight.from_blocks(w.embed)
        model.embed = nn.Parameter(model.embed.data.new_empty(0), requires_grad=False)
        if arch.tie_embeddings:  # a tied head multiplies the same blocks
            use_blocks(model, "lm_head", model.embed_blocks)
    else:
        _put(model.embed, _dense(w.embed), "the embedding")  # a tied head is this parameter
    if not arch.tie_embeddings:
        _put_matrix(model, "lm_head", w.head, device, "the head")
    return model


def _slot(block: Block, attr: str) -> tuple[nn.Module, str]:
    """Where a layer's matrix goes: the block, its mixture (router_w), or one of its experts
    (``expert.E.gate_up_w``)."""
    moe = block.moe
    if moe is not None and attr == "router_w":
        return moe, attr
    if moe is not None and attr.startswith("expert."):
        _, e, name = attr.split(".")
        expert: nn.Module = moe.experts[int(e)]
        return expert, name
    return block, attr


def use_blocks(module: nn.Module, attr: str, weight: BlockWeight) -> None:
    """Replace a dense matrix parameter by block weights (freeing the dense tensor)."""
    module._parameters.pop(attr, None)
    object.__setattr__(module, attr, weight)


def _put_matrix(module: nn.Module, attr: str, m: Matrix, device: torch.device, what: str) -> None:
    if isinstance(m, Blocks) and device.type == "cpu":
        use_blocks(module, attr, BlockWeight.from_blocks(m))
    else:
        _put(getattr(module, attr), _dense(m), what)


def _dense(m: Matrix) -> Dense:
    """A matrix's values as the torch model takes a dense one (a Stacked one's parts in
    float32: torch multiplies one dtype per matrix)."""
    return m.dequantize() if isinstance(m, Blocks | Stacked) else m


def _put(param: nn.Parameter, a: Dense, what: str) -> None:
    """``a`` as the parameter's data: shared where it can be, else copied (converting)."""
    if tuple(param.shape) != a.shape:
        raise ModelLoadError(f"{what} has shape {a.shape}, expected {tuple(param.shape)}")
    with warnings.catch_warnings():  # a read-only view is only read here: copied below
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        t = torch.from_numpy(a.view(np.int16) if a.dtype == np.uint16 else a)
    if a.dtype == np.uint16:
        t = t.view(torch.bfloat16)  # the bits of bfloat16 weights (weight_arrays.py)
    shareable = a.flags.writeable and a.flags.c_contiguous and param.device.type == "cpu"
    if shareable and t.dtype == param.dtype:
        param.data = t
    else:
        param.data.copy_(t)
