"""What every rank of a tensor-parallel group holds and does, rank 0 included: its shard of the
torch model, its share of every K/V cell, the host buffers of its share of swapped parks, and
the one handler of rank 0's commands (``RankShard.handle``), which runs the same collectives in
the same order on every rank.

A command is ``(kind, args, frees)``: the host buffers in ``frees`` (ids rank 0 no longer holds)
are dropped first, then

    step     plan                 run the step's rows (page copies first); rank 0 gets the logits
    alloc    (id, bytes)          a host buffer of ``bytes`` for this rank's share -> all ranks ok?
    save     (id, cells)          this rank's share of those cells into buffer ``id`` -> all ok?
    restore  (id, cells, first)   buffer ``id`` back into cells (from ``first``) -> all ok?
    embed    token ids            the prompt's embedding (every rank computes it; rank 0 returns)
    stop                          the worker loop ends

A rank whose allocation or save fails says so and the answer is "not ok" on every rank: rank 0
then turns the park into a recompute (runner/tp_runner.py), which asks nothing of any rank.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Any

import torch

from kvpark.config.cpus import usable_cpus
from kvpark.config.env import tp_fail_save_rank
from kvpark.config.layers import EngineConfig, ModelConfig
from kvpark.model.numpy_weights import read_model
from kvpark.model.ops import KVCache, block_weights
from kvpark.model.sources import default_model_path
from kvpark.model.torch_weights import torch_model
from kvpark.model.tp_model import Collectives, ShardedLlama
from kvpark.model.tp_shard import shard_weights
from kvpark.runner.batch import build_step_tensors
from kvpark.runner.cpu_paths import CpuPaths, exact_cpu_threads, resolve_cpu_paths
from kvpark.runner.embedding import embed_tokens
from kvpark.runner.torch_runner import resolve_dtype, select_ops, torch_dtype
from kvpark.runner.tp_group import TpGroup
from kvpark.sched.plan import StepPlan

log = logging.getLogger("kvpark.runner.tp")
Message = tuple[str, Any, list[int]]


def tp_cpu_paths(model: ModelConfig) -> CpuPaths:
    """The CPU paths of a rank: the torch runner's rule for dense weights (float32 activations
    unless ``--dtype`` says otherwise; ``--kv-dtype auto`` as for dense weights)."""
    return resolve_cpu_paths(replace(model, weights="dense", prompt_path="same"))


class RankShard:
    def __init__(self, config: EngineConfig, group: TpGroup) -> None:
        m = config.model
        self.group = group
        self.rank, self.world, self.device = group.rank, group.world, group.device
        self.ops = select_ops(m.exact, self.device)
        self.cpu_paths: CpuPaths | None = None
        if self.device.type == "cpu":
            self.cpu_paths = tp_cpu_paths(m)
            self.dtype = torch_dtype(self.cpu_paths.dtype)
            self.kv_dtype = torch_dtype(self.cpu_paths.kv_dtype)
            # the ranks share the machine: each takes its share of the CPUs
            threads = m.threads or max(1, usable_cpus() // self.world)
            threads = exact_cpu_threads(threads) if m.exact else threads
            torch.set_num_threads(threads)
            block_weights.set_threads(threads)  # the Rust attention kernel's
        else:
            self.dtype = self.kv_dtype = resolve_dtype(m.dtype, self.device)
        weights, self.tokenizer, self.name = read_model(
            m.model or default_model_path(), dense_dtype=str(self.dtype).removeprefix("torch.")
        )
        self.arch = weights.arch  # the whole model's
        shard = shard_weights(weights, self.rank, self.world)
        del weights
        comm = Collectives(self.rank, self.world, m.exact, group.steps)
        make = functools.partial(ShardedLlama, comm=comm, vocab=self.arch.vocab_size)
        self.model = torch_model(shard, self.dtype, self.device, make=make).eval()
        self.page_size = config.pool.page_size
        self.kv = KVCache.allocate(
            shard.arch, config.pool.kv_cells // self.page_size, self.page_size, self.kv_dtype,
            self.device,
        )  # fmt: skip
        self.buffers: dict[int, torch.Tensor] = {}
        self.fail_saves = self.rank > 0 and tp_fail_save_rank() == self.rank  # a test knob

    def handle(self, message: Message) -> Any:
        """Carry out one of rank 0's commands (module docstring) on this rank."""
        kind, args, frees = message
        for buffer_id in frees:
            self.buffers.pop(buffer_id, None)
        if kind == "step":
            return self.step(args)
        if kind == "alloc":
            return self.group.all_ok(self._try(self._alloc, *args))
        if kind == "save":
            return self.group.all_ok(self._try(self._save, *args))
        if kind == "restore":
            return self.group.all_ok(self._try(self._restore, *args))
        if kind == "window_space":
            return self.group.all_ok(self._try(self._window_space, args))
        if kind == "embed":
            return embed_tokens(self.model, self.ops, args, self.page_size, self.dtype, self.device)
        raise ValueError(f"unknown tensor-parallel command {kind!r}")

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> torch.Tensor:
        if plan.page_copies:
            self.kv.copy_pages(plan.page_copies)
        s = build_step_tensors(plan, self.page_size, self.device)
        logits: torch.Tensor = self.model(
            s.token_ids, s.positions, s.meta, self.kv, s.logit_rows, self.ops
        )
        return logits

    def _window_space(self, n_pages: int) -> None:
        """The sliding layers' K/V in ``n_pages`` pages of their own (TpRunner.use_window_space),
        before the first step."""
        pages, arch = self.kv.n_pages, self.model.arch
        del self.kv  # the old tensors go before the new ones are taken (a GPU's memory)
        self.kv = KVCache.allocate(
            arch, pages, self.page_size, self.kv_dtype, self.device, window_pages=n_pages
        )

    def _try(self, action: Any, *args: Any) -> bool:
        try:
            action(*args)
            return True
        except Exception as e:  # this rank says no; every rank hears it (all_ok)
            log.warning("rank %d: %s failed: %s", self.rank, action.__name__.strip("_"), e)
            return False

    def _alloc(self, buffer_id: int, n_bytes: int) -> None:
        elem = self.kv.k[0].element_size()
        pin = self.device.type == "cuda"
        self.buffers[buffer_id] = torch.empty(
            -(-n_bytes // elem), dtype=self.kv_dtype, pin_memory=pin
        )

    def _save(self, buffer_id: int, cells: list[int]) -> None:
        if self.fail_saves:
            raise MemoryError(f"KVPARK_TP_FAIL_SAVE={self.rank}")
        self.kv.save_cells(cells, self.buffers[buffer_id])

    def _restore(self, buffer_id: int, cells: list[int], first: int) -> None:
        self.kv.restore_cells(self.buffers[buffer_id], cells, first)
