"""The prefix cache through kvpark._core.KvPool: register, hit, evict, the off switch.

Mirrors rust/tests/prefix_cache_cases.rs at the binding's level: only what crosses into Python
(argument conversion, tuples, None, exceptions) is new here.
"""

from __future__ import annotations

import pytest

from kvpark._core import KvPool

PAGE = 4


def computed(pool: KvPool, seq_id: int, tokens: list[int]) -> KvPool:
    """The engine's order: reserve the rows, run the step, then register their token ids."""
    pool.add_sequence(seq_id)
    pool.reserve(seq_id, len(tokens))
    pool.register_tokens(seq_id, tokens)
    pool.check_integrity()
    return pool


def test_the_cache_is_off_by_default_and_changes_nothing() -> None:
    pool = computed(KvPool(32, PAGE), 1, list(range(9)))
    assert pool.prefix_cache_salt is None
    assert pool.registered_len(1) == 0
    assert pool.free_sequence(1) == 12
    assert (pool.cells_cached(), pool.cells_free()) == (0, 32)
    pool.add_sequence(2)
    assert pool.match_prefix(2, list(range(9)), 8) == 0
    assert pool.cached_prefix(list(range(9)), 9) == (0, 0)


def test_a_released_prompt_is_cached_and_the_next_request_takes_it() -> None:
    prompt = list(range(10))
    pool = computed(KvPool(32, PAGE, prefix_cache_salt=2**64 - 1), 1, prompt)
    assert pool.prefix_cache_salt == 2**64 - 1
    assert pool.page_key(0) is not None and pool.page_key(2) is None  # page 2 partly used
    pool.free_sequence(1)
    assert (pool.cells_used(), pool.cells_cached(), pool.cells_free()) == (0, 8, 32)
    assert "cells_cached=8" in repr(pool)
    # Admission: the pure queries, then the hit.
    assert pool.cached_prefix(prompt, len(prompt) - 1) == (8, 8)
    assert pool.cells_to_admit(prompt, len(prompt) - 1, len(prompt)) == 12
    pool.add_sequence(2)
    assert pool.match_prefix(2, prompt, len(prompt) - 1) == 8
    assert pool.page_table(2) == [0, 1]
    assert (pool.seq_len(2), pool.registered_len(2), pool.cells_cached()) == (8, 8, 0)
    # Only the rest is computed, then registered with the step's other rows.
    pool.reserve(2, 12)
    assert pool.register_step([2, 2], [[8, 9], [20, 21]]) == 1
    pool.check_integrity()


def test_eviction_takes_free_pages_first_then_the_least_recently_cached_leaf() -> None:
    pool = KvPool(5 * PAGE, PAGE, prefix_cache_salt=7)
    computed(pool, 1, list(range(8)))  # pages 0, 1
    computed(pool, 2, list(range(50, 54)))  # page 2
    pool.free_sequence(1)
    pool.free_sequence(2)
    assert pool.eviction_order() == [1, 0, 2]
    pool.add_sequence(3)
    assert pool.reserve(3, 20) == [3, 4, 1, 0, 2]
    assert pool.cells_cached() == 0 and pool.page_key(1) is None
    pool.check_integrity()


def test_bad_calls_raise_and_change_nothing() -> None:
    pool = computed(KvPool(16, PAGE, prefix_cache_salt=0), 1, [1, 2, 3])
    with pytest.raises(ValueError, match="out of range"):
        pool.register_tokens(1, [4])  # only 3 cells held
    with pytest.raises(ValueError, match="differ in length"):
        pool.register_step([1], [])
    with pytest.raises(KeyError):
        pool.register_tokens(9, [1])
    with pytest.raises(ValueError, match="empty sequence"):
        pool.match_prefix(1, [1, 2, 3, 4, 5], 4)
    with pytest.raises(ValueError):
        pool.page_key(4)
    with pytest.raises(OverflowError):
        KvPool(16, PAGE, prefix_cache_salt=-1)
    assert pool.registered_len(1) == 3
    pool.check_integrity()


def test_reset_empties_the_cache_and_keeps_it_on() -> None:
    pool = computed(KvPool(16, PAGE, prefix_cache_salt=3), 1, list(range(8)))
    pool.free_sequence(1)
    pool.reset()
    assert pool.cells_cached() == 0 and pool.prefix_cache_salt == 3
    assert pool.cached_prefix(list(range(8)), 8) == (0, 0)
