"""The numeric ops the model runs, chosen per mode as one :class:`OpSet`.

``llama.py`` calls every matmul, norm, rope, KV store and attention through an OpSet, never torch
directly, so that exact mode (docs/exact.md) can swap in batch-invariant versions without
touching the model.
``OpSet.default()`` is the fast torch reference path; ``OpSet.exact()`` is row-invariant:
fixed row tiles for matmuls and, for attention, one kernel entry per row on the CPU (fixed query
tiles and key chunks elsewhere), with the row-wise norm, rope and KV store of the default set.
A weight is a tensor or a ``BlockWeight`` (a GGUF block-quantised matrix kept as blocks,
``--weights blocks``); every set's ``linear`` multiplies the latter with ``block_linear``, which
is row-invariant in both modes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from kvpark.model.ops import (
    attention,
    exact_attention,
    kv_cache,
    linear,
    norm,
    prompt_linear,
    rope,
    tiled_linear,
)
from kvpark.model.ops.block_weights import BlockWeight, block_linear
from kvpark.model.ops.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kvpark.model.arch import ModelArch

Tensor = torch.Tensor
Weight = Tensor | BlockWeight
LinearOp = Callable[[Tensor, Weight, Tensor | None], Tensor]


def with_blocks(op: Callable[[Tensor, Tensor, Tensor | None], Tensor]) -> LinearOp:
    """``op`` for tensor weights, ``block_linear`` for block weights."""

    def linear(x: Tensor, weight: Weight, bias: Tensor | None = None) -> Tensor:
        if isinstance(weight, BlockWeight):
            return block_linear(x, weight, bias)
        return op(x, weight, bias)

    linear.__name__ = linear.__qualname__ = getattr(op, "__name__", "linear")
    return linear


@dataclass(frozen=True)
class OpSet:
    name: str
    # whether a row's result is independent of the other rows of a step (exact mode needs it)
    row_invariant: bool
    # x [rows, in], weight [out, in] (a tensor or a BlockWeight), bias [out] | None -> [rows, out]
    linear: LinearOp
    # x [..., d], weight [d], eps -> [..., d]
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    # x [T, heads, D], cos, sin [T, 1, D] -> [T, heads, D]
    rope: Callable[[Tensor, Tensor, Tensor], Tensor]
    # k_cache, v_cache [pages, page_size, kv_heads, D], slot_mapping [T], k, v [T, kv_heads, D]
    store_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]
    # (meta, arch, KV dtype) -> a plan built once per step and handed to every layer's attention
    prepare_attention: Callable[[AttentionMetadata, ModelArch, torch.dtype], Any]
    # q [T, heads, D], k_cache, v_cache, plan -> [T, heads, D]
    attention: Callable[[Tensor, Tensor, Tensor, Any], Tensor]

    def for_prompt_chunks(self) -> OpSet:
        """This set for a step that holds a prompt chunk: block weights multiply through their
        dense copies (``--prompt-path``, ops/prompt_linear.py)."""
        if self.row_invariant:
            raise ValueError("exact mode keeps prompt and decode rows on one arithmetic")
        return replace(self, name=f"{self.name}+dense prompts", linear=prompt_linear.prompt_linear)

    @staticmethod
    def default() -> OpSet:
        return _DEFAULT

    @staticmethod
    def exact() -> OpSet:
        return _EXACT


_DEFAULT = OpSet(
    name="default",
    row_invariant=False,
    linear=with_blocks(linear.linear),
    rms_norm=norm.rms_norm_cpu,
    rope=rope.apply_rope,
    store_kv=kv_cache.store_kv,
    prepare_attention=attention.prepare,
    attention=attention.paged_attention,
)

_EXACT = OpSet(
    name="exact",
    row_invariant=True,
    linear=with_blocks(tiled_linear.tiled_linear),
    rms_norm=norm.rms_norm_cpu,  # row-wise reductions: invariant as they are
    rope=rope.apply_rope,  # elementwise products and sums: exact per element
    store_kv=kv_cache.store_kv,
    prepare_attention=exact_attention.prepare,
    attention=exact_attention.exact_attention,
)
