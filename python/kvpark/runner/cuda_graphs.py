"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches a few hundred small kernels; at small batches their launch cost, not the
GPU, sets the step time. A pure-decode step (every sequence one row, every row sampled) of ``b``
sequences is instead copied into static buffers and replayed from the graph of the smallest bucket
``B >= b`` that was captured over those buffers. Anything else (prompt chunks, a batch above the
largest bucket, a context wider than the buffers) runs eagerly.

Static inputs, sized to the largest bucket and the widest context ``W`` (rows past ``b`` pad)::

    token_ids    [B]        int64   padding: 0
    positions    [B]        int64   padding: 0
    slot_mapping [B]        int64   where each row's K and V go; padding: the scratch cell
    page_tables  [B, W/ps]  int32   each sequence's pages; padding: the scratch page
    row_pos      [B]        int32   the last position a row attends to (its own); padding: 0
    row_seq      [B]        int32   0..B-1, constant: row r is sequence r
    inside the graph: cell_index [B, W] = page_tables * page_size + offset, then the model

Padding rows write their K and V to the **scratch page**, one page past the pool's last: the
runner allocates it and the Rust pool, sized to ``--kv-cells``, never hands it out. They attend to
that one cell and their logits are dropped. Columns of ``page_tables`` past a row's own pages keep
stale page ids; the attention kernel never reads past ``row_pos``.

Only the Triton op sets qualify: their attention takes its per-step inputs as tensors
(``TritonAttentionPlan``), so nothing in the forward builds a tensor from host data. In exact mode
the ops are row-invariant, so a padded replay gives a row the same bits as an eager step.
Each bucket is captured the first time a step needs it, with every row padding, so warming up and
capturing touch only the scratch page.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch

from kvpark.model.ops import KVCache, OpSet
from kvpark.model.ops.metadata import AttentionMetadata
from kvpark.model.ops.triton_ops import TritonAttentionPlan
from kvpark.runner.batch import build_padded_decode
from kvpark.sched.plan import StepPlan

log = logging.getLogger("kvpark.runner.torch_runner")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Widest context a graph serves: cell_index [B, W] is rebuilt on every replay, so W costs a little
# per step; a wider step runs eagerly, where attention dominates anyway.
MAX_GRAPH_CELLS = 16384


def graphs_wanted(enabled: bool, device: torch.device, ops: OpSet) -> bool:
    """CUDA graphs serve the Triton op sets on CUDA (see the module docstring)."""
    return enabled and device.type == "cuda" and ops.name.startswith("triton")


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        ops: OpSet,
        max_cells: int,
        buckets: tuple[int, ...] = BUCKETS,
        capture: bool = True,  # False: run the static-buffer forward eagerly (CPU tests)
    ) -> None:
        self.model, self.kv, self.ops, self.buckets = model, kv, ops, buckets
        self.capture = capture
        self.page_size = kv.page_size
        self.scratch_page = kv.n_pages - 1  # the page the pool never hands out
        self.max_pages = -(-min(max_cells, MAX_GRAPH_CELLS) // self.page_size)
        top, device = max(buckets), kv.k[0].device
        scratch_cell = self.scratch_page * self.page_size
        self.token_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), scratch_cell, dtype=torch.int64, device=device)
        self.page_tables = torch.full(
            (top, self.max_pages), self.scratch_page, dtype=torch.int32, device=device
        )
        self.row_pos = torch.zeros(top, dtype=torch.int32, device=device)
        self.row_seq = torch.arange(top, dtype=torch.int32, device=device)
        self.logit_rows = torch.arange(top, dtype=torch.int64, device=device)
        self.offsets = torch.arange(self.page_size, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (CUDAGraph, logits)
        self._pool: Any = None  # one memory pool shared by every bucket's graph

    def bucket_for(self, plan: StepPlan) -> int | None:
        """The bucket a step replays in, or None when it must run eagerly."""
        if not plan.items or len(plan.items) > self.buckets[-1]:
            return None
        if any(len(i.token_ids) != 1 or not i.sample for i in plan.items):
            return None
        if max(len(t) for t in plan.page_tables) > self.max_pages:
            return None
        return next(b for b in self.buckets if b >= len(plan.items))

    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """Logits [sampled rows, vocab] float32 of a pure-decode step; None: run it eagerly."""
        bucket = self.bucket_for(plan)
        if bucket is None:
            return None
        if self.capture and bucket not in self._graphs:
            self._fill(StepPlan([], [], []), bucket)  # all padding while capturing
            self._capture(bucket)
        self._fill(plan, bucket)
        if not self.capture:
            return self._forward(bucket)[: len(plan.items)]
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[: len(plan.items)].clone()  # the next replay overwrites the static output

    def _fill(self, plan: StepPlan, bucket: int) -> None:
        """Copy the step, padded to ``bucket`` rows by batch.py, into the static buffers."""
        step = build_padded_decode(plan, bucket, self.scratch_page, self.page_size)
        width = step.page_tables.shape[1]
        self.token_ids[:bucket].copy_(step.token_ids, non_blocking=True)
        self.positions[:bucket].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:bucket].copy_(step.slot_mapping, non_blocking=True)
        self.row_pos[:bucket].copy_(step.positions, non_blocking=True)  # a row sees itself last
        self.page_tables[:bucket, :width].copy_(step.page_tables, non_blocking=True)

    def _forward(self, bucket: int) -> torch.Tensor:
        """The model over the static buffers' first ``bucket`` rows (what a graph captures)."""
        tables = self.page_tables[:bucket]
        cells = (tables[:, :, None] * self.page_size + self.offsets).reshape(bucket, -1)
        plan = TritonAttentionPlan(cells, self.row_seq[:bucket], self.row_pos[:bucket])
        ops = replace(self.ops, prepare_attention=lambda meta, arch, dtype: plan)
        meta = AttentionMetadata(  # read only by store_kv (slot_mapping): prepare is replaced
            slot_mapping=self.slot_mapping[:bucket],
            query_start=list(range(bucket + 1)),
            context_lens=[1] * bucket,
            cell_index=cells,
            max_query_len=1,
        )
        logits: torch.Tensor = self.model(
            self.token_ids[:bucket],
            self.positions[:bucket],
            meta,
            self.kv,
            self.logit_rows[:bucket],
            ops,
        )
        return logits

    def _capture(self, bucket: int) -> None:
        started = time.perf_counter()
        device = self.kv.k[0].device
        side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up off the capture: Triton compiles, cuBLAS sets up
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(bucket)
        self._pool = graph.pool()
        self._graphs[bucket] = (graph, logits)
        log.info(
            "captured the decode step for %d sequences in a CUDA graph in %.0f ms",
            bucket,
            (time.perf_counter() - started) * 1000,
        )
