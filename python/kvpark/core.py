"""kvpark's Rust core, for people who write their own runner or scheduler: the KV cell pool with its
page tables and occupancy queries, and the preemption planner (the crate ``kvpark-core``, compiled
as ``kvpark._core``, re-exported here with names for its string values).

Vocabulary: a *cell* holds one token's K and V in every layer; a *page* is ``page_size``
consecutive cells, the unit of allocation; a sequence's *page table* lists its pages in logical
order, so its position ``q`` lives in cell ``table[q // page_size] * page_size + q % page_size``
(:func:`cells_of`). A runner stores K/V per cell; the pool only decides which cells are whose.

Documentation: the classes' and methods' docstrings are the Rust ``///`` comments of
``rust/py/``, which PyO3 copies into ``__doc__`` (``help(KvPool.cells_freed_by)`` shows them);
``kvpark/_core.pyi`` repeats them with the types and is checked against the compiled module by
``python -m mypy.stubtest kvpark._core``. How the planner chooses: docs/preemption.md.

Example: two sequences in a 64-cell pool, what removing one of them would free, and what the planner
parks when the next step does not fit (tests/core/test_core_api.py runs it)::

    >>> from kvpark.core import KvPool, Planner, RequestView
    >>> pool = KvPool(64, page_size=16)  # 4 pages; fresh pages come out 0, 1, 2, ...
    >>> pool.add_sequence(1)
    >>> pool.add_sequence(2)
    >>> pool.reserve(1, 20)  # 20 cells: 2 pages
    [0, 1]
    >>> pool.reserve(2, 5)
    [2]
    >>> pool.slot_mapping(1, 16, 4)  # the cells of positions 16..19
    [16, 17, 18, 19]
    >>> pool.cells_used(), pool.cells_freed_by([2, 2])  # a sequence given twice counts once
    (48, 16)
    >>> cell_bytes = 4096  # what one cell's K and V take in the runner: a swap's state is n * that
    >>> views = [  # next step: sequence 1 grows to 21 cells (2 pages), 2 to 40 (3 pages)
    ...     RequestView(id=1, arrival=1, seq_ids=[1], next_cells=[(1, 21)], slot=0,
    ...                 state_bytes=20 * cell_bytes),
    ...     RequestView(id=2, arrival=2, seq_ids=[2], next_cells=[(2, 40)], slot=1,
    ...                 state_bytes=5 * cell_bytes),
    ... ]
    >>> planner = Planner(policy="fcfs", margin_cells=0, ram_budget_bytes=2**20)
    >>> actions = planner.plan(pool, views, slot_buffer_capacity=[0, 0], now_ms=0)
    >>> [(a.kind, a.request, a.mode, a.buffer_capacity) for a in actions]  # newest parks
    [('park', 2, 'swap', 65536)]
    >>> pool.free_sequence(2)  # the caller carries the park out: save its cells, free them
    16
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvpark._core import Action, KvPool, Planner, PoolFullError, RequestView, round_up_buffer
from kvpark.config.layers import PreemptPolicy

__all__ = [
    "Action",
    "ActionKind",
    "KvPool",
    "PageCopy",
    "ParkMode",
    "Planner",
    "Policy",
    "PoolFullError",
    "RequestView",
    "ViewState",
    "cells_of",
    "round_up_buffer",
]

Policy = PreemptPolicy
"""``Planner(policy=...)``: one of ``kvpark.config.layers.PREEMPT_POLICIES`` (``fcfs`` parks the
newest running request and resumes the oldest parked first; ``cost`` parks the one whose pages
cover the shortfall with the fewest cells)."""
ParkMode = Literal["swap", "recompute"]
"""How a request is parked: its cells copied to host memory, or dropped and its tokens replayed."""
ViewState = Literal["running", "parked", "parking", "restoring"]
"""``RequestView.state``: where a request in a slot stands, as the planner sees it (the engine's
own states, ``kvpark.sched.request.RequestState``, add ``waiting`` and ``finished``)."""
ActionKind = Literal["release_buffer", "park", "resume", "rotate", "fail"]
"""``Action.kind``."""
PageCopy = tuple[int, int]
"""``(src_page, dst_page)`` from ``KvPool.fork`` / ``truncate``: the runner copies the cells."""


def cells_of(page_table: Sequence[int], page_size: int, start: int, count: int) -> list[int]:
    """The flat cells of positions ``start .. start + count`` of a sequence with this page table
    (what ``KvPool.slot_mapping`` returns, for a runner that has only a step plan's tables).

    ValueError when the table's pages do not reach that far.
    """
    if start < 0 or count < 0 or start + count > len(page_table) * page_size:
        raise ValueError(
            f"positions {start}..{start + count} are outside {len(page_table)} pages of "
            f"{page_size} cells"
        )
    return [
        page_table[q // page_size] * page_size + q % page_size for q in range(start, start + count)
    ]
