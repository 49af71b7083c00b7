"""Preemption helpers for the engine-level tests: a fake asynchronous copier whose copies land
only after some polls, and the check that an engine left nothing behind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import kvpark
from kvpark._core import KvPool
from kvpark.preempt.buffers import CellCopier
from kvpark.preempt.copies import Transfer


def assert_clean(llm: kvpark.LLM) -> None:
    engine = llm.engine
    assert not engine.has_work
    assert engine.scheduler.pool.cells_used() == 0
    engine.scheduler.pool.check_integrity()
    assert engine.stats.preempt_ram_bytes == 0
    assert engine.stats.requests_preempted == 0


class PendingCopy:
    def __init__(self, polls: int, copy: Callable[[], None], on_land: Callable[[], None]) -> None:
        self.left = polls
        self.landed = False
        self._copy = copy
        self._on_land = on_land

    def done(self) -> bool:
        if not self.landed:
            self.left -= 1
            if self.left <= 0:
                self._land()
        return self.landed

    def wait(self) -> None:
        if not self.landed:
            self._land()

    def _land(self) -> None:
        self._on_land()
        self._copy()
        self.landed = True


class PolledTransfers:
    """Asynchronous transfers whose copies land on the ``polls``-th ``done()``."""

    asynchronous = True

    def __init__(self, copier: CellCopier, pool: KvPool, polls: int, pinned: bool = True) -> None:
        self.copier = copier
        self.pool = pool
        self.polls = polls
        self.pinned = pinned
        self.copies: list[tuple[str, PendingCopy]] = []
        self.used_at_landing: list[int] = []  # pool cells in use when each copy landed

    def host_buffer(self, n_bytes: int) -> torch.Tensor:
        return self.copier.host_buffer(n_bytes)

    def overlaps(self, buf: torch.Tensor) -> bool:
        return self.pinned

    def save(self, cells: list[int], out: torch.Tensor) -> Transfer:
        return self._issue("save", lambda: self.copier.save_cells(cells, out))

    def restore(self, src: torch.Tensor, cells: list[int], first: int = 0) -> Transfer:
        # cells before ``first``: a resume's cached prefix, which the copy leaves alone
        copier: Any = self.copier
        return self._issue("restore", lambda: copier.restore_cells(src, cells, first=first))

    def _issue(self, kind: str, copy: Callable[[], None]) -> PendingCopy:
        pending = PendingCopy(self.polls, copy, self._record)
        self.copies.append((kind, pending))
        return pending

    def _record(self) -> None:
        self.used_at_landing.append(self.pool.cells_used())

    def count(self, kind: str) -> int:
        return sum(k == kind for k, _ in self.copies)

    def in_flight(self) -> list[PendingCopy]:
        return [c for _, c in self.copies if not c.landed]
