from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpark._core import KvPool, PoolFullError


def pool_with(n_cells: int, page_size: int, seq_id: int, n_tokens: int) -> KvPool:
    pool = KvPool(n_cells, page_size)
    pool.add_sequence(seq_id)
    pool.reserve(seq_id, n_tokens)
    return pool


def test_geometry() -> None:
    pool = KvPool(64)
    assert (pool.n_cells, pool.page_size, pool.n_pages) == (64, 16, 4)
    assert pool.cells_free() == 64 and pool.cells_used() == 0
    for n_cells, page_size in [(0, 16), (16, 0), (20, 16)]:
        with pytest.raises(ValueError):
            KvPool(n_cells, page_size)
    with pytest.raises(AttributeError):
        pool.page_size = 8  # type: ignore[misc]


def test_sequences() -> None:
    pool = KvPool(64, 16)
    pool.add_sequence(5)
    pool.add_sequence(2)
    assert pool.sequences() == [2, 5]
    assert pool.has_sequence(5) and not pool.has_sequence(3)
    assert pool.seq_len(5) == 0 and pool.page_table(5) == []
    with pytest.raises(ValueError):
        pool.add_sequence(5)
    pool.reset()
    assert pool.sequences() == []
    assert pool.cells_free() == 64


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.seq_len(9),
        lambda p: p.page_table(9),
        lambda p: p.pages_needed(9, 1),
        lambda p: p.reserve(9, 1),
        lambda p: p.truncate(9, 0),
        lambda p: p.fork(9, 10),
        lambda p: p.free_sequence(9),
        lambda p: p.slot_mapping(9, 0, 0),
        lambda p: p.export_step([1, 9], [0, 0], [0, 0]),
        lambda p: p.cells_freed_by([1, 9]),
    ],
)
def test_unknown_sequence_is_key_error(call: Callable[[KvPool], object]) -> None:
    pool = pool_with(64, 16, 1, 3)
    with pytest.raises(KeyError, match="unknown sequence 9"):
        call(pool)
    pool.check_integrity()


def test_reserve_is_all_or_nothing() -> None:
    pool = pool_with(48, 16, 1, 17)
    assert pool.page_table(1) == [0, 1]
    assert pool.pages_needed(1, 49) == 2
    with pytest.raises(PoolFullError, match=r"needed 2 pages \(32 cells\), 1 free \(16 cells\)"):
        pool.reserve(1, 49)
    assert (pool.seq_len(1), pool.page_table(1), pool.cells_free()) == (17, [0, 1], 16)
    with pytest.raises(ValueError):
        pool.reserve(1, 16)
    assert pool.reserve(1, 32) == []
    assert pool.reserve(1, 48) == [2]
    assert pool.pages_needed(1, 48) == 0
    assert not pool.can_fit(1) and pool.can_fit(0)
    assert issubclass(PoolFullError, Exception)


def test_fork_shares_full_pages_and_copies_a_partial_one() -> None:
    pool = pool_with(64, 16, 1, 20)  # pages [0, 1]; page 1 holds 4 cells
    assert pool.fork(1, 2) == [(1, 2)]
    assert pool.page_table(2) == [0, 2]
    assert pool.seq_len(2) == 20
    assert [pool.page_refcount(p) for p in range(4)] == [2, 1, 1, 0]
    pool.reserve(1, 32)
    assert pool.fork(1, 3) == []  # full pages only: shared, no copy
    assert pool.page_refcount(1) == 2
    with pytest.raises(ValueError):
        pool.fork(1, 2)  # child exists
    with pytest.raises(KeyError):
        pool.fork(7, 8)  # parent unknown
    pool.reserve(2, 21)
    pool.add_sequence(4)
    pool.reserve(4, 1)  # the last free page
    with pytest.raises(PoolFullError):
        pool.fork(2, 5)
    assert not pool.has_sequence(5)
    pool.check_integrity()


def test_truncate_copies_a_shared_partial_tail() -> None:
    pool = pool_with(64, 16, 1, 32)  # [0, 1]
    pool.fork(1, 2)  # shares both
    assert pool.truncate(1, 20) == [(1, 2)]
    assert pool.page_table(1) == [0, 2] and pool.page_table(2) == [0, 1]
    assert pool.truncate(1, 16) == []  # page 2 released; page 0 full
    assert pool.page_refcount(2) == 0
    assert pool.truncate(1, 0) == []
    assert pool.page_table(1) == []
    with pytest.raises(ValueError):
        pool.truncate(1, 1)
    pool.check_integrity()


def test_free_sequence_returns_cells_nobody_else_holds() -> None:
    pool = pool_with(64, 16, 1, 40)  # [0, 1, 2]
    pool.fork(1, 2)  # shares 0, 1; copies 2 into 3
    assert pool.free_sequence(1) == 16
    assert not pool.has_sequence(1)
    assert pool.free_sequence(2) == 48
    assert pool.cells_free() == 64
    # Pages come back out in the freed sequence's logical order (LIFO free list).
    pool.add_sequence(3)
    assert pool.reserve(3, 64) == [0, 1, 3, 2]


def test_occupancy_spec_examples() -> None:
    """docs/preemption.md's pool rules: a shared cell counted once, a partly used page in full,
    a duplicate once."""
    pool = pool_with(128, 16, 1, 33)  # 3 pages, the last holding 1 cell
    assert pool.cells_used() == 48  # a partly used page counts in full
    pool.fork(1, 2)
    assert pool.cells_used() == 64  # pages 0 and 1 once, each tail its own
    assert pool.cells_freed_by([1]) == 16  # only 1's private tail
    assert pool.cells_freed_by([1, 1]) == 16  # given twice, counted once
    assert pool.cells_freed_by([1, 2]) == 64
    assert pool.cells_freed_by([2, 1, 2]) == 64
    assert pool.cells_freed_by([]) == 0
    assert pool.cells_free() == 64
    assert pool.can_fit(64) and not pool.can_fit(65)
    assert pool.free_sequence(1) == 16
    assert pool.cells_used() == 48


def test_slot_mapping_and_export_step() -> None:
    pool = pool_with(64, 16, 1, 20)  # [0, 1]
    pool.fork(1, 2)  # [0, 2]
    assert pool.slot_mapping(1, 14, 4) == [14, 15, 16, 17]
    assert pool.slot_mapping(2, 15, 3) == [15, 32, 33]
    assert pool.slot_mapping(2, 20, 0) == []
    with pytest.raises(ValueError):
        pool.slot_mapping(2, 19, 2)
    slots, tables = pool.export_step([2, 1], [16, 0], [2, 1])
    assert slots == [32, 33, 0]
    assert tables == [[0, 2], [0, 1]]
    assert pool.export_step([], [], []) == ([], [])
    with pytest.raises(ValueError):
        pool.export_step([1], [0, 0], [1])
    with pytest.raises(ValueError):
        pool.export_step([1, 2], [0, 19], [1, 2])


def test_page_refcount_range() -> None:
    pool = KvPool(32, 16)
    assert pool.page_refcount(1) == 0
    with pytest.raises(ValueError):
        pool.page_refcount(2)


def test_check_integrity_after_a_workload() -> None:
    pool = KvPool(256, 4)
    for seq in range(4):
        pool.add_sequence(seq)
        pool.reserve(seq, 5 + 3 * seq)
    pool.fork(3, 10)
    pool.fork(10, 11)
    pool.truncate(11, 6)
    pool.reserve(10, 30)
    pool.free_sequence(0)
    pool.check_integrity()
    held = {page for seq in pool.sequences() for page in pool.page_table(seq)}
    assert pool.cells_used() == len(held) * pool.page_size
    assert pool.cells_used() + pool.cells_free() == pool.n_cells
    assert "cells_used=" in repr(pool)
