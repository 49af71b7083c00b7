"""``kvpark.core``: the Rust pool, page tables, occupancy queries and planner, as users import them.

Its module docstring's example runs here (doctest), the Rust doc comments reach ``__doc__``, and
``cells_of`` agrees with the pool's own slot mapping.
"""

from __future__ import annotations

import doctest
import random

import pytest

import kvpark._core
import kvpark.core
from kvpark.core import KvPool, cells_of


def test_the_module_example_runs() -> None:
    result = doctest.testmod(kvpark.core, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10 and result.failed == 0


def test_every_rust_type_is_the_compiled_one() -> None:
    for name in ("Action", "KvPool", "Planner", "PoolFullError", "RequestView", "round_up_buffer"):
        assert getattr(kvpark.core, name) is getattr(kvpark._core, name)
    # everything public; the underscored names are the CPU kernels, reached through kvpark.model.ops
    public = {name for name in kvpark._core.__all__ if not name.startswith("_")}
    assert set(kvpark.core.__all__) >= public


def test_rust_doc_comments_reach_python() -> None:
    # PyO3 turns the `///` comments of rust/py/ into __doc__: help() shows them
    assert "The KV cell pool" in (KvPool.__doc__ or "")
    assert "All or nothing" in (KvPool.reserve.__doc__ or "")
    assert "A sequence given twice counts once" in (KvPool.cells_freed_by.__doc__ or "")
    assert "preemption planner" in (kvpark.core.Planner.__doc__ or "")


def test_cells_of_agrees_with_the_pool() -> None:
    rng = random.Random(3)
    pool = KvPool(512, page_size=16)
    for seq in range(6):
        pool.add_sequence(seq)
    for _ in range(40):  # interleaved growth and frees scatter the pages
        seq = rng.randrange(6)
        if rng.random() < 0.2:
            pool.free_sequence(seq)
            pool.add_sequence(seq)
        else:
            pool.reserve(seq, min(pool.seq_len(seq) + rng.randrange(1, 30), 80))
    for seq in range(6):
        n = pool.seq_len(seq)
        start = rng.randrange(n + 1)
        table = pool.page_table(seq)
        assert cells_of(table, 16, start, n - start) == pool.slot_mapping(seq, start, n - start)
    with pytest.raises(ValueError, match="outside"):
        cells_of([3], 16, 10, 7)
