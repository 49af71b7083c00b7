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
from typing import cast

import numpy as np
import torch

import kvpark._core as _core
from kvpark.config.layers import ModelConfig, PoolConfig
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.llama import Block, LlamaModel
from kvpark.model.ops import BlockWeight
from kvpark.runner.batch import takes_prompt_path
from kvpark.runner.cpu_decoder import (
    Array,
    DecoderInputs,
    DecoderLayer,
    build_decoder,
    run_step,
    sampled_rows,
)
from kvpark.runner.torch_runner import TorchRunner
from kvpark.sched.plan import StepPlan

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
    def _build_decoder(self) -> _core._CpuDecoder:
        """The decoder over numpy views of the model's own tensors (no copy)."""
        model: LlamaModel = self.loaded.model
        layers: list[DecoderLayer] = []
        for i, module in enumerate(model.layers):
            layer = cast(Block, module)
            assert isinstance(layer.qkv_w, BlockWeight) and isinstance(layer.o_w, BlockWeight)
            assert isinstance(layer.gate_up_w, BlockWeight)
            assert isinstance(layer.down_w, BlockWeight)
            layers.append(
                DecoderLayer(
                    attn_norm=_array(layer.attn_norm),
                    qkv=_blocks(layer.qkv_w),
                    o=_blocks(layer.o_w),
                    mlp_norm=_array(layer.mlp_norm),
                    gate_up=_blocks(layer.gate_up_w),
                    down=_blocks(layer.down_w),
                    k_cells=_array(self.kv.k[i]),
                    v_cells=_array(self.kv.v[i]),
                    qkv_bias=_optional(layer.qkv_b),
                    o_bias=_optional(layer.o_b),
                    q_norm=_optional(layer.q_norm),
                    k_norm=_optional(layer.k_norm),
                )
            )
        assert isinstance(model.lm_head, BlockWeight) and model.embed_blocks is not None
        self._inputs = DecoderInputs()
        return build_decoder(
            self.loaded.arch,
            layers,
            _blocks(model.embed_blocks),
            _array(model.norm),
            _blocks(model.lm_head),
            (_array(model.rope.cos), _array(model.rope.sin)),
            _POOL_DTYPES[self.kv.k[0].dtype],
            model.lm_head.int8,  # set_block_dot set every matrix alike
            self._inputs,
        )

    # ---------------------------------------------------------------- one step
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        if self.decoder is None or takes_prompt_path(plan, self.prompt_min_rows):
            return super().execute(plan)  # the torch model: its dense prompt GEMM
        if plan.page_copies:
            self.kv.copy_pages(plan.page_copies)
        logits = torch.empty(sampled_rows(plan), self.vocab_size, dtype=torch.float32)
        if not plan.empty:
            run_step(self.decoder, plan, self.page_size, logits.numpy())
        return logits


def _optional(t: torch.Tensor | None) -> Array | None:
    return None if t is None else _array(t)


def _array(t: torch.Tensor) -> Array:
    """A CPU tensor's memory as numpy (16-bit floats as their bits where numpy lacks the type)."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("the decoder takes contiguous CPU tensors")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _blocks(w: BlockWeight) -> Blocks:
    return w.blocks()
