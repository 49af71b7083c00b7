"""``--tensor-parallel N``: the ``kvpark.Runner`` of rank 0, which shards kvpark's torch model
over N ranks (torch.distributed: NCCL on CUDA, gloo on the CPU), so that the engine, the
scheduler and the Rust planner run as they do for one process, on rank 0 alone.

::

    engine ── plan ──► TpRunner.execute ── ("step", plan) ──► ranks 1..N-1 (tp_worker.py)
                          │ its own shard (tp_rank.py)           their shards
                          ◄──────── all-reduces, logits gathered on rank 0 ────────►
    parking ─► host_buffer / save_cells / restore_cells: the same command to every rank, each
               carrying out its share of the cells; the answers combined (all ok?)

Each step's plan is sent once (plain data, pickled, through the group's store: tp_group.py);
every rank writes its share of the heads of every cell the plan names. A park is decided once,
by the planner on rank 0: a swap moves each rank's share into that rank's host memory; if any
rank cannot take the buffer or save its share, ``host_buffer`` or ``save_cells`` raises
``MemoryError`` and the park becomes a recompute, which touches no rank (the cells are dropped
in the pool, on rank 0). A rank that is gone (it exited, or a collective with it failed or timed
out) raises ``RunnerFailed``: the engine then fails every request and the server exits 1.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import weakref
from typing import Any

import torch

from kvpark.config.layers import EngineConfig
from kvpark.runner.cpu_paths import CpuPaths
from kvpark.runner.failures import RunnerFailed
from kvpark.runner.tp_checks import tp_config_refusal
from kvpark.runner.tp_group import TpGroup, start_group
from kvpark.runner.tp_rank import RankShard
from kvpark.sched.plan import StepPlan
from kvpark.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("kvpark.runner.tp")


class ShardedBuffer:
    """A swap park's host buffer: rank 0's share here, the other ranks' under the same id in
    their processes. ``nbytes`` counts every rank's (what ``--preempt-ram`` bounds)."""

    def __init__(self, buffer_id: int, local: torch.Tensor, nbytes: int) -> None:
        self.id = buffer_id
        self.local = local
        self.nbytes = nbytes


class TpRunner:
    """Rank 0 of a tensor-parallel group, as a ``kvpark.Runner``."""

    def __init__(self, config: EngineConfig) -> None:
        why = tp_config_refusal(config.model)
        if why is not None:
            raise ValueError(why)
        started = time.perf_counter()
        self.world = config.model.tensor_parallel
        self.group: TpGroup = start_group(self.world, config.model.device)
        self._ids = itertools.count(1)
        self._frees: list[int] = []  # buffers rank 0 dropped: the other ranks drop them next
        try:
            self.group.send(config)
            self.shard = RankShard(config, self.group)
        except BaseException:
            self._abandon()
            raise
        if not self.group.all_loaded(True):
            self._abandon()
            raise RuntimeError("a rank of the tensor-parallel group failed to load the model")
        log.info(
            "tensor parallel: model %s on %d ranks in %.1f s (%s heads a rank)",
            self.shard.name,
            self.world,
            time.perf_counter() - started,
            self.shard.model.arch.n_heads,
        )

    def _abandon(self) -> None:
        with contextlib.suppress(Exception):
            self.group.all_loaded(False)  # the workers wait on it after loading
        for proc in self.group.workers:
            proc.kill()

    # ----------------------------------------------------------------- what the engine reads
    @property
    def tokenizer(self) -> Tokenizer:
        return self.shard.tokenizer

    @property
    def model_name(self) -> str:
        return self.shard.name

    @property
    def vocab_size(self) -> int:
        return self.shard.arch.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.shard.arch.max_position

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends over: each rank's share of the pages behind it goes."""
        return self.shard.arch.pool_window

    @property
    def kv_window_split(self) -> int | None:
        """The window of a model mixing sliding and global layers (Gemma 2 and 3): every rank
        can keep its share of the sliding layers' K/V in a window space (use_window_space)."""
        arch = self.shard.arch
        mixed = any(arch.sliding_layers) and not all(arch.sliding_layers)
        return arch.sliding_window if mixed else None

    def use_window_space(self, n_cells: int) -> None:
        """Every rank keeps its sliding layers' K/V in ``n_cells`` cells of their own (a
        collective: the next command may then replace this one in the store)."""
        if not self._command("window_space", n_cells // self.shard.page_size):
            raise RuntimeError(
                "a rank of the tensor-parallel group could not take its window space"
            )

    @property
    def row_invariant(self) -> bool:
        return self.shard.ops.row_invariant

    @property
    def cpu_paths(self) -> CpuPaths | None:
        """What ``/props.cpu`` shows (None on CUDA)."""
        return self.shard.cpu_paths

    @property
    def runner_kind(self) -> str:
        return "torch"

    @property
    def tensor_parallel(self) -> int:
        return self.world

    def execute(self, plan: StepPlan) -> torch.Tensor:
        logits: torch.Tensor = self._command("step", plan)
        return logits

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        embedding: torch.Tensor = self._command("embed", list(token_ids))
        return embedding

    # ----------------------------------------------------------------- parking
    def bytes_per_cell(self) -> int:
        return self.shard.kv.bytes_per_cell() * self.world  # every rank's share

    def host_buffer(self, n_bytes: int) -> ShardedBuffer:
        """A buffer of ``n_bytes`` over all ranks (each its share); ``MemoryError`` when a rank
        cannot have its share: the park then recomputes."""
        buffer_id = next(self._ids)
        share = -(-n_bytes // self.world)
        if not self._command("alloc", (buffer_id, share)):
            self._frees.append(buffer_id)
            raise MemoryError(f"a rank could not take {share} bytes for a park")
        buf = ShardedBuffer(buffer_id, self.shard.buffers[buffer_id], n_bytes)
        del self.shard.buffers[buffer_id]  # rank 0's share lives and dies with the handle
        weakref.finalize(buf, self._freed, buffer_id)
        return buf

    def _freed(self, buffer_id: int) -> None:
        self._frees.append(buffer_id)

    def save_cells(self, cells: list[int], out: ShardedBuffer) -> None:
        self.shard.buffers[out.id] = out.local
        try:
            if not self._command("save", (out.id, cells)):
                raise MemoryError("a rank of the tensor-parallel group could not save its share")
        finally:
            del self.shard.buffers[out.id]

    def restore_cells(self, src: ShardedBuffer, cells: list[int], first: int = 0) -> None:
        self.shard.buffers[src.id] = src.local
        try:
            if not self._command("restore", (src.id, cells, first)):
                raise RunnerFailed("a rank of the tensor-parallel group lost a parked state")
        finally:
            del self.shard.buffers[src.id]

    # ----------------------------------------------------------------- the group
    def _command(self, kind: str, args: Any) -> Any:
        """Send a command to the other ranks and carry it out here; ``RunnerFailed`` when a
        rank is gone (whatever rank 0's side of a collective raised)."""
        frees, self._frees = self._frees, []
        message = (kind, args, frees)
        try:
            self.group.send(message)
            return self.shard.handle(message)
        except RunnerFailed:
            raise
        except Exception as e:
            try:
                self.group.check_workers()  # name the rank that went, where we know it
            except RunnerFailed as gone:
                raise gone from e
            raise RunnerFailed(f"the tensor-parallel group failed: {e}") from e

    def close(self) -> None:
        """Stop the other ranks (nothing may run on the runner meanwhile, nor after)."""
        self.group.close()
