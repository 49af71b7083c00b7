"""A step's rows (step_rows.py, the one place a plan becomes rows) as the torch runner's tensors:
token ids, positions, slot mapping, cell indices.

::

    cell_index[b]   seq b's cells 0..context_len-1, read through its page table, 0-padded
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvpark.model.ops.metadata import AttentionMetadata
from kvpark.runner.step_rows import StepRows, plan_rows, takes_prompt_path
from kvpark.sched.plan import StepPlan


@dataclass(frozen=True)
class StepTensors:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [S] int64: the rows whose logits are drawn from
    # whether the step holds prompt chunks (items of more than one row) of >= prompt_min_rows
    # rows in all: then its rows take the dense prompt path (cpu_paths.py)
    prompt_chunk: bool = False


def build_step_tensors(
    plan: StepPlan, page_size: int, device: torch.device, prompt_min_rows: int | None = None
) -> StepTensors:
    """``prompt_min_rows``: see :func:`takes_prompt_path` (cpu_paths.py)."""
    rows = plan_rows(plan)
    window = None
    if plan.window_slot_mapping is not None and plan.window_page_tables is not None:
        window = _metadata(
            rows, plan.window_slot_mapping, plan.window_page_tables, page_size, device
        )
    meta = _metadata(rows, plan.slot_mapping, plan.page_tables, page_size, device, window)
    return StepTensors(
        token_ids=torch.tensor(rows.tokens, dtype=torch.int64, device=device),
        positions=torch.tensor(rows.positions, dtype=torch.int64, device=device),
        meta=meta,
        logit_rows=torch.tensor(rows.sample_rows, dtype=torch.int64, device=device),
        prompt_chunk=takes_prompt_path(plan, prompt_min_rows),
    )


def _metadata(
    rows: StepRows,
    slot_mapping: list[int],
    page_tables: list[list[int]],
    page_size: int,
    device: torch.device,
    window: AttentionMetadata | None = None,
) -> AttentionMetadata:
    """The rows' cells in one space: the pool's, or a window space's (``window``: the latter's,
    for the sliding layers)."""
    query_start, context_lens = rows.query_start, rows.context_lens
    max_pages = max(len(t) for t in page_tables)
    tables = torch.zeros((len(page_tables), max_pages), dtype=torch.int64)
    for b, table in enumerate(page_tables):
        tables[b, : len(table)] = torch.tensor(table, dtype=torch.int64)
    offsets = torch.arange(page_size, dtype=torch.int64)
    cells = (tables[:, :, None] * page_size + offsets).reshape(len(page_tables), -1)
    cell_index = cells[:, : max(context_lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start=query_start,
        context_lens=context_lens,
        cell_index=cell_index.to(device),
        max_query_len=max(b - a for a, b in itertools.pairwise(query_start)),
        window=window,
    )


@dataclass(frozen=True)
class PaddedDecode:
    """A pure-decode step padded to a CUDA-graph bucket (cuda_graphs.py), host tensors: rows past
    the plan's write to the scratch page and attend to position 0."""

    token_ids: torch.Tensor  # [bucket] int64; padding 0
    positions: torch.Tensor  # [bucket] int64; padding 0
    slot_mapping: torch.Tensor  # [bucket] int64; padding: the scratch page's first cell
    page_tables: torch.Tensor  # [bucket, widest table] int32; padding: the scratch page


def build_padded_decode(
    plan: StepPlan, bucket: int, scratch_page: int, page_size: int
) -> PaddedDecode:
    """The decode plan (every item one sampled row; may be empty) padded to ``bucket`` rows."""
    n, pad = len(plan.items), bucket - len(plan.items)
    ints = torch.tensor(
        [
            [i.token_ids[0] for i in plan.items] + [0] * pad,
            [i.start for i in plan.items] + [0] * pad,
            list(plan.slot_mapping) + [scratch_page * page_size] * pad,
        ],
        dtype=torch.int64,
    )
    width = max((len(t) for t in plan.page_tables), default=1)
    tables = torch.full((bucket, width), scratch_page, dtype=torch.int32)
    for row, table in enumerate(plan.page_tables[:n]):
        t = torch.tensor(table, dtype=torch.int32)
        # a page given back behind a sliding window (-1) is never read: point it at the scratch
        # page, so that no kernel can index outside the pool
        tables[row, : len(table)] = torch.where(t < 0, scratch_page, t)
    return PaddedDecode(ints[0], ints[1], ints[2], tables)
