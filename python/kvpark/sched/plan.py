"""The plain data a scheduler step hands to the runner: which rows of which sequences, on which
cells.

No tensors here; ``runner/batch.py`` is the one place this becomes tensors for the built-in runner
(a custom runner reads these lists its own way, see docs/custom-runners.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepItem:
    """Rows ``start .. start + len(token_ids)`` of one sequence."""

    seq_id: int
    start: int  # position of the first row (= cells already computed)
    token_ids: list[int]
    sample: bool  # the last row's logits are drawn from (it is the sequence's newest known token)


@dataclass(frozen=True)
class StepPlan:
    """One step for the runner. Rows are the items' tokens, concatenated in item order; row ``r``
    of item ``b`` sits at position ``items[b].start + r`` of its sequence, writes its K/V at cell
    ``slot_mapping[row]``, and attends over its sequence's positions ``0 .. its own`` (position
    ``q`` of item ``b`` is cell ``page_tables[b][q // page_size] * page_size + q % page_size``).
    Every ``(src, dst)`` in ``page_copies`` copies page ``src``'s cells onto page ``dst`` before
    anything runs (a forked sequence's private copy of a shared, partly used page).

    A model mixing sliding-window and global layers may keep its sliding layers' K/V in a cell
    space of their own, the window space (``sched/window_space.py``): then each row writes those
    layers' K/V at ``window_slot_mapping[row]`` of that space and reads them through
    ``window_page_tables`` (``-1`` for pages behind the window), and a page number in
    ``page_copies`` at or past the pool's page count names page ``p - n_pages`` of the window
    space. Both None: every layer uses ``slot_mapping`` and ``page_tables``."""

    items: list[StepItem]
    slot_mapping: list[int]  # flat cell index for every row, in item order
    page_tables: list[list[int]]  # per item: the sequence's pages in logical order
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write before running
    window_slot_mapping: list[int] | None = None  # the sliding layers' cells in the window space
    window_page_tables: list[list[int]] | None = None  # and their pages there

    @property
    def n_rows(self) -> int:
        return len(self.slot_mapping)

    @property
    def empty(self) -> bool:
        return not self.items
