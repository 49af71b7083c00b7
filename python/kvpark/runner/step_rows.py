"""The one place a step plan becomes rows: every runner (the Rust decoder's lists, the torch
runner's tensors, a custom runner) reads a plan through :func:`plan_rows`.

::

    plan.items[b]   seq 7: start=32, 1 row         seq 9: start=0, 5 rows (a prompt chunk)
    tokens          [ t7_32 | t9_0 t9_1 t9_2 t9_3 t9_4 ]
    positions       [ 32    | 0    1    2    3    4    ]
    item_rows       [1, 5]          query_start [0, 1, 6]          context_lens [33, 5]
    sample_rows     [0, 5]          (each sampled item's last row)

Plain lists, no torch: the decoder takes them as they are, batch.py turns them into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpark.sched.plan import StepPlan


@dataclass(frozen=True)
class StepRows:
    tokens: list[int]  # [T] every row's token, item after item
    positions: list[int]  # [T] each row's position in its sequence
    item_rows: list[int]  # [B] rows per item
    query_start: list[int]  # [B + 1] the first row of each item, then T
    context_lens: list[int]  # [B] cells each item attends to once its rows are written
    sample_rows: list[int]  # [S] the rows whose logits are drawn from, in item order


def plan_rows(plan: StepPlan) -> StepRows:
    tokens: list[int] = []
    positions: list[int] = []
    item_rows: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    sample_rows: list[int] = []
    for item in plan.items:
        n = len(item.token_ids)
        tokens += item.token_ids
        positions += range(item.start, item.start + n)
        item_rows.append(n)
        query_start.append(query_start[-1] + n)
        context_lens.append(item.start + n)
        if item.sample:
            sample_rows.append(query_start[-1] - 1)
    return StepRows(tokens, positions, item_rows, query_start, context_lens, sample_rows)


def sampled_rows(plan: StepPlan) -> int:
    """How many rows of logits a step returns."""
    return sum(1 for item in plan.items if item.sample)


def takes_prompt_path(plan: StepPlan, prompt_min_rows: int | None) -> bool:
    """Whether a step goes through the torch runner's dense prompt GEMM (an explicit
    ``--prompt-path``, cpu_paths.py): its prompt (or replay) rows, summed over its items of more
    than one row, are at least ``prompt_min_rows``. Summed, because a GEMM's speed follows the
    rows it multiplies at once: eight conversations' next turns of 30 rows each are one 240-row
    product, as fast dense as one 240-row chunk. Decode rows (items of one row) never count: a
    step of decodes alone stays on the blocks."""
    if prompt_min_rows is None:
        return False
    rows = sum(len(item.token_ids) for item in plan.items if len(item.token_ids) > 1)
    return rows >= prompt_min_rows
