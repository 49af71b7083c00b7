"""The lean runner's matrices in one mapping advised for transparent huge pages
(runner/huge_pages.py): the copies, their alignment, the advice where the kernel takes it, every
matrix of the real default model moved there, and its logits bit for bit those of numpy's own
arrays (``KVPARK_HUGE_PAGES=off``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvpark.runner.lean_runner as lean_runner
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.model.gguf_blocks import Blocks
from kvpark.runner.huge_pages import ALIGN, HUGE_PAGE, Arena
from kvpark.sched.plan import StepItem, StepPlan

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vma_of(address: int) -> dict[str, str]:
    """The fields of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


def test_the_arena_copies_each_array_at_a_cache_line_boundary() -> None:
    rng = np.random.default_rng(3)
    arrays = [
        rng.standard_normal((7, 33)).astype(np.float32),
        rng.integers(-128, 128, (5, 40), dtype=np.int8),
        rng.standard_normal((3, 17)).astype(np.float16)[:, ::2],  # not contiguous
        rng.integers(0, 2**16, (9,), dtype=np.uint16),
    ]
    arena = Arena(sum(a.nbytes + ALIGN for a in arrays))
    copies = [arena.take(a) for a in arrays]
    ends = []
    for a, c in zip(arrays, copies, strict=True):
        assert c.dtype == a.dtype and c.shape == a.shape and c.flags.c_contiguous
        assert np.array_equal(c, a) and c.ctypes.data % ALIGN == 0
        assert c.ctypes.data >= arena.start + (ends[-1] if ends else 0)
        ends.append(c.ctypes.data - arena.start + c.nbytes)
    assert copies[0].ctypes.data % HUGE_PAGE == 0  # the first on a huge page's boundary
    with pytest.raises(ValueError, match="no room"):
        arena.take(np.zeros(HUGE_PAGE * 2, np.uint8))


@pytest.mark.skipif(not THP.exists(), reason="no transparent huge pages on this kernel")
def test_the_arena_is_advised_for_huge_pages() -> None:
    arena = Arena(4 * HUGE_PAGE)
    first = arena.take(np.ones(3 * HUGE_PAGE // 4, np.float32))
    assert arena.advised
    vma = vma_of(first.ctypes.data)
    assert vma, "the arena's mapping is not in /proc/self/smaps"
    # eligible unless the system turned them off (given or not is the kernel's choice); a
    # kernel older than 5.0 does not say
    never = "[never]" in THP.read_text()
    assert vma.get("THPeligible", "0" if never else "1") == ("0" if never else "1")


def load(monkeypatch: pytest.MonkeyPatch, huge: bool) -> lean_runner.LeanCpuRunner:
    monkeypatch.setenv("KVPARK_HUGE_PAGES", "on" if huge else "off")
    model = ModelConfig(threads=2)
    return lean_runner.LeanCpuRunner.load(
        EngineConfig(model=model, pool=PoolConfig(kv_cells=64, page_size=16))
    )


def test_every_matrix_moves_and_the_logits_keep_their_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logits = {}
    for huge in (True, False):
        r = load(monkeypatch, huge)
        arena = r._arena
        assert (arena is not None) is huge
        arrays = [
            a
            for p in r.weights.matrix_parts()
            for a in ([p.qs, p.scale, p.offset] if isinstance(p, Blocks) else [p])
            if a is not None
        ]
        if arena is not None:  # every array of every matrix lies in the one mapping
            size = arena._bytes.size
            assert all(0 <= a.ctypes.data - arena.start < size for a in arrays)
        tokens = r.tokenizer.encode("The ocean is deep and the sky is")
        first = StepPlan([StepItem(0, 0, tokens, True)], list(range(len(tokens))), [[0]])
        after = StepPlan([StepItem(0, len(tokens), [11], True)], [len(tokens)], [[0]])
        logits[huge] = np.stack([r.execute(first)[0], r.execute(after)[0]])
    assert np.isfinite(logits[True]).all()
    assert logits[True].tobytes() == logits[False].tobytes()


def test_a_bad_switch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPARK_HUGE_PAGES", "maybe")
    config = EngineConfig(model=ModelConfig(threads=2), pool=PoolConfig(kv_cells=64))
    with pytest.raises(ValueError, match="KVPARK_HUGE_PAGES"):
        lean_runner.LeanCpuRunner.load(config)
