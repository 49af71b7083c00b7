"""The CPU runner that runs a whole decode step in one Rust call (``--runner native``).

Through torch a decode step of the default model is ~450 ops, each a dispatch and an allocation,
and 120 of them crossings into the Rust block kernels: at one row that overhead is as large as
the arithmetic. ``NativeCpuRunner`` loads the model and the KV pool as the torch runner does,
then hands the addresses of every weight, the rope tables and the pool to
``_core._CpuDecoder`` (``rust/cpu_ops/src/decoder``) once; each step passes the plan's plain
lists and gets the sampled rows' logits back. Every op of that path is row-invariant, so exact
mode rides it too, prompt rows included (each row attends as its own entry).

Which steps run where (docs/cpu-kernels.md):

- a step holding prompt chunks in normal mode (at least ``prompt_min_rows`` rows in its items
  of more than one row, ``batch.takes_prompt_path``, where ``--prompt-path`` gives a dense
  GEMM) runs through the torch model, which is faster for wide row counts;
- every other step, and in exact mode every step, runs in Rust.

The decoder needs block weights for every layer matrix, the head and the token embedding, and
multiplies them as ``--block-dot`` says (int8 or float32 activations, as the torch runner's
``block_linear`` does); a model without them (``--weights dense``, a CPU without AVX2, a
safetensors checkpoint) runs all of its steps through torch, and ``--runner native`` refuses
it instead.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

import torch

import kvpark._core as _core
from kvpark.config.layers import ModelConfig, PoolConfig
from kvpark.model.llama import Block, LlamaModel
from kvpark.model.ops import BlockWeight
from kvpark.runner.batch import takes_prompt_path
from kvpark.runner.torch_runner import TorchRunner
from kvpark.sched.plan import StepPlan

if TYPE_CHECKING:
    from kvpark._core import _LayerSpec, _Matrix

log = logging.getLogger("kvpark.runner.native_runner")

_POOL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class NativeCpuRunner(TorchRunner):
    """``kvpark.Runner`` for the CPU: the torch runner's model and pool, with decode steps (and
    in exact mode every step) run by the Rust decoder."""

    def __init__(
        self, model_config: ModelConfig, pool_config: PoolConfig, *, required: bool = False
    ) -> None:
        """``required``: refuse a model the decoder cannot run (``--runner native``) instead of
        running it through torch."""
        super().__init__(model_config, pool_config)
        why = self._unfit()
        self.decoder: _core._CpuDecoder | None = None
        if why is not None:
            if required:
                raise ValueError(f"--runner native cannot run this model: {why}")
            log.info("runner: torch (the native decoder cannot run this model: %s)", why)
            return
        self._keep: list[torch.Tensor] = []  # every tensor whose address the decoder holds
        self.decoder = self._build_decoder()
        log.info("runner: native (whole decode steps in Rust)")

    @property
    def runner_kind(self) -> str:
        return "torch" if self.decoder is None else "native"

    def _unfit(self) -> str | None:
        if self.device.type != "cpu":
            return f"it runs on {self.device.type}"
        if self.kv_dtype not in _POOL_DTYPES:
            return f"the KV pool is {self.kv_dtype}"
        model = self.loaded.model
        if model.dtype != torch.float32:
            return f"the activations are {model.dtype}"
        for i, layer in enumerate(model.layers):
            for attr in ("qkv_w", "o_w", "gate_up_w", "down_w"):
                if not isinstance(getattr(layer, attr), BlockWeight):
                    return f"layer {i}'s {attr} is not in blocks (--weights blocks, a GGUF)"
        if not isinstance(model.lm_head, BlockWeight):
            return "the head is not in blocks"
        if model.embed_blocks is None:
            return "the token embedding is not in blocks"
        return None

    # ---------------------------------------------------------------- building the decoder
    def _addr(self, t: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> int:
        """The address of a live, contiguous CPU tensor of ``dtype`` (0 for None)."""
        if t is None:
            return 0
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"the decoder takes contiguous {dtype} CPU tensors, not {t.dtype}")
        self._keep.append(t)
        return t.data_ptr()

    def _matrix(self, w: BlockWeight) -> _Matrix:
        n, k = w.shape  # BlockWeight checked its tensors' dtypes, shapes and contiguity
        qs_dtype = torch.uint8 if w.kind == "q4" else torch.int8
        return {
            "kind": w.kind[1],
            "qs": self._addr(w.qs, qs_dtype),
            "scale": self._addr(w.scale),
            "offset": self._addr(w.offset),
            "n": n,
            "k": k,
        }

    def _build_decoder(self) -> _core._CpuDecoder:
        model: LlamaModel = self.loaded.model
        a = self.loaded.arch
        pool_dtype = self.kv.k[0].dtype
        layers: list[_LayerSpec] = []
        for i, module in enumerate(model.layers):
            layer = cast(Block, module)
            assert isinstance(layer.qkv_w, BlockWeight) and isinstance(layer.o_w, BlockWeight)
            assert isinstance(layer.gate_up_w, BlockWeight)
            assert isinstance(layer.down_w, BlockWeight)
            layers.append(
                {
                    "attn_norm": self._addr(layer.attn_norm.data),
                    "qkv": self._matrix(layer.qkv_w),
                    "qkv_bias": self._addr(_data(layer.qkv_b)),
                    "q_norm": self._addr(_data(layer.q_norm)),
                    "k_norm": self._addr(_data(layer.k_norm)),
                    "o": self._matrix(layer.o_w),
                    "o_bias": self._addr(_data(layer.o_b)),
                    "mlp_norm": self._addr(layer.mlp_norm.data),
                    "gate_up": self._matrix(layer.gate_up_w),
                    "down": self._matrix(layer.down_w),
                    "k_cells": self._addr(self.kv.k[i], pool_dtype),
                    "v_cells": self._addr(self.kv.v[i], pool_dtype),
                }
            )
        assert isinstance(model.lm_head, BlockWeight) and model.embed_blocks is not None
        rope = model.rope
        shape = (a.hidden_size, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size)
        return _core._CpuDecoder(
            (*shape, a.vocab_size),
            a.rms_eps,
            self._matrix(model.embed_blocks),
            self._addr(model.norm.data),
            self._matrix(model.lm_head),
            self._addr(rope.cos),
            self._addr(rope.sin),
            rope.cos.numel(),
            layers,
            self.kv.k[0].numel(),
            _POOL_DTYPES[pool_dtype],
            "int8" if model.lm_head.int8 else "float32",  # set_block_dot set every matrix alike
        )

    # ---------------------------------------------------------------- one step
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        if self.decoder is None or takes_prompt_path(plan, self.prompt_min_rows):
            return super().execute(plan)  # the torch model: its dense prompt GEMM
        if plan.page_copies:
            self.kv.copy_pages(plan.page_copies)
        if plan.empty:
            return torch.empty(0, self.vocab_size, dtype=torch.float32)
        tokens: list[int] = []
        positions: list[int] = []
        item_rows: list[int] = []
        logit_rows: list[int] = []
        for item in plan.items:
            n = len(item.token_ids)
            tokens += item.token_ids
            positions += range(item.start, item.start + n)
            item_rows.append(n)
            if item.sample:
                logit_rows.append(len(tokens) - 1)
        logits = torch.empty(len(logit_rows), self.vocab_size, dtype=torch.float32)
        self.decoder.step(
            tokens,
            positions,
            plan.slot_mapping,
            item_rows,
            plan.page_tables,
            self.page_size,
            logit_rows,
            logits.data_ptr(),
        )
        return logits


def _data(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.data
