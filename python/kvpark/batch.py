"""The one place a step plan becomes tensors: token ids, positions, slot mapping, cell indices.

::

    plan.items[b]   seq 7: start=32, 1 row         seq 9: start=0, 5 rows (a prompt chunk)
    rows            [ t7_32 | t9_0 t9_1 t9_2 t9_3 t9_4 ]
    query_start     [0, 1, 6]
    context_lens    [33, 5]
    cell_index[b]   seq b's cells 0..context_len-1, read through its page table, 0-padded
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvpark.ops.metadata import AttentionMetadata
from kvpark.plan import StepPlan


@dataclass(frozen=True)
class StepTensors:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [S] int64: the rows whose logits are drawn from
    # rows of prompt chunks (items of >= prompt_min_rows rows) and the step's other rows, when
    # the step has such chunks (None otherwise; ``other_rows`` None: every row is a chunk's)
    prompt_rows: torch.Tensor | None = None
    other_rows: torch.Tensor | None = None


def build_step_tensors(
    plan: StepPlan, page_size: int, device: torch.device, prompt_min_rows: int | None = None
) -> StepTensors:
    """``prompt_min_rows``: items of at least that many rows are prompt chunks (cpu_paths.py)."""
    tokens: list[int] = []
    positions: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    logit_rows: list[int] = []
    for item in plan.items:
        n = len(item.token_ids)
        tokens += item.token_ids
        positions += range(item.start, item.start + n)
        query_start.append(query_start[-1] + n)
        context_lens.append(item.start + n)
        if item.sample:
            logit_rows.append(query_start[-1] - 1)
    max_pages = max(len(t) for t in plan.page_tables)
    tables = torch.zeros((len(plan.items), max_pages), dtype=torch.int64)
    for b, table in enumerate(plan.page_tables):
        tables[b, : len(table)] = torch.tensor(table, dtype=torch.int64)
    offsets = torch.arange(page_size, dtype=torch.int64)
    cells = (tables[:, :, None] * page_size + offsets).reshape(len(plan.items), -1)
    cell_index = cells[:, : max(context_lens)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(plan.slot_mapping, dtype=torch.int64, device=device),
        query_start=query_start,
        context_lens=context_lens,
        cell_index=cell_index.to(device),
        max_query_len=max(query_start[i + 1] - query_start[i] for i in range(len(plan.items))),
    )
    prompt_rows, other_rows = _split_rows(query_start, prompt_min_rows, device)
    return StepTensors(
        token_ids=torch.tensor(tokens, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta,
        logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=device),
        prompt_rows=prompt_rows,
        other_rows=other_rows,
    )


def _split_rows(
    query_start: list[int], min_rows: int | None, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if min_rows is None:
        return None, None
    chunk: list[int] = []
    other: list[int] = []
    for lo, hi in itertools.pairwise(query_start):
        (chunk if hi - lo >= min_rows else other).extend(range(lo, hi))
    if not chunk:
        return None, None
    as_tensor = torch.tensor(chunk, dtype=torch.int64, device=device)
    return as_tensor, torch.tensor(other, dtype=torch.int64, device=device) if other else None
