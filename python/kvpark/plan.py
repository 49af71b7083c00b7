"""The plain data a scheduler step hands to the runner: which rows of which sequences, on which
cells.

No tensors here; ``batch.py`` is the one place this becomes tensors.
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
    items: list[StepItem]
    slot_mapping: list[int]  # flat cell index for every row, in item order
    page_tables: list[list[int]]  # per item: the sequence's pages in logical order
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write before running

    @property
    def n_rows(self) -> int:
        return len(self.slot_mapping)

    @property
    def empty(self) -> bool:
        return not self.items
