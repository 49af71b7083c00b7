"""Gemma's sliding layers keep their K/V in a window space of their own (sched/window_space.py,
docs/models.md "Pages"): on tiny Gemma 2 and Gemma 3 models (tests/support/tiny_arch.py: every
other layer attends over its last 8 positions, the others over the whole context) a long request
runs with the sliding layers' arrays a fraction of the global layers', holding at most its window
and one step's rows there, with tokens and logprobs bitwise those of a pool where every layer
keeps every cell (exact mode), on the lean runner and the torch runner; forced swap and
recompute parks, a warm prefix cache and ``n = 3`` choices change no bit, and every cell of both
spaces comes back.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

import kvpark
from kvpark import SamplingParams
from kvpark.config.layers import SchedulerConfig
from kvpark.engine.llm_engine import LLMEngine
from kvpark.engine.outputs import TokenEvent, TokenLogprob
from kvpark.engine.props import describe_props
from kvpark.engine.stats import EngineStats
from kvpark.model.gguf_file import GgufFile
from kvpark.model.sources import default_model_path
from kvpark.sched.window_space import window_space_cells
from kvpark.server.metrics import EngineCollector
from kvpark.tokenizer.tokenizer import Tokenizer
from support import tiny_tp
from support.tiny_arch import WINDOW, save_arch, write_gguf

PAGE = 4
CELLS = 256  # the pool: the long request's 190-odd positions fit; the window space far fewer
OPTIONS: dict[str, object] = {"kv_cells": CELLS, "parallel": 4, "max_batch_tokens": 24}
LONG = "Rivers of Europe: the Danube, the Rhine, the Elbe, the Loire and the Po. " * 4
OTHERS = ["Write a limerick about a cat.", "Explain recursion in two lines."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
Run = tuple[dict[str, list[TokenLogprob]], int]
RUNNERS = ["lean", "torch"]


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    root = tmp_path_factory.mktemp(request.param)
    tokenizer = Tokenizer.from_gguf_metadata(GgufFile(default_model_path()).metadata)
    save_arch(request.param, tokenizer, root)
    yield root
    shutil.rmtree(root, ignore_errors=True)  # ~100 MB a model (the real vocabulary)


def make(
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    every: int = 0,
    runner: str = "lean",
    **options: object,
) -> LLMEngine:
    torch.set_num_threads(1)
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", str(every))
    monkeypatch.setenv("KVPARK_PREEMPT_FAIL_SAVE", "0")
    llm = kvpark.LLM(
        model=str(root),
        runner=runner,
        exact=True,
        page_size=PAGE,
        threads=1,
        **{**OPTIONS, **options},
    )
    return llm.engine


def encode(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run(engine: LLMEngine, texts: dict[str, str | list[int]]) -> Run:
    """Every request added at once and run to the end: each one's logprobs, and the most cells
    the window space held after any step (0 without one)."""
    for rid, text in texts.items():
        ids = text if isinstance(text, list) else encode(engine, text)
        engine.check_request(ids, GREEDY)
        engine.add_request(rid, ids, GREEDY)
    got: dict[str, list[TokenLogprob]] = {rid: [] for rid in texts}
    space = engine.scheduler.cells.space
    peak = 0
    while engine.has_work:
        for rid, events in engine.step().items():
            for ev in events:
                if isinstance(ev, TokenEvent) and ev.logprobs is not None:
                    got[rid].extend(ev.logprobs)
        peak = max(peak, space.pool.cells_used() if space else 0)
        # the gauge of /metrics, refreshed after every step
        assert engine.stats.kv_window_cells_used == (space.pool.cells_used() if space else 0)
    for pool in (engine.scheduler.pool, *([space.pool] if space else [])):
        assert pool.cells_used() == 0
        pool.check_integrity()
    return got, peak


@pytest.fixture(scope="module")
def kept(gemma: Path) -> dict[str, Run]:
    """Per runner: the long request alone, every layer keeping every cell."""
    mp = pytest.MonkeyPatch()
    try:
        return {
            r: run(make(gemma, mp, runner=r, window_release=False), {"long": LONG}) for r in RUNNERS
        }
    finally:
        mp.undo()


def arrays(engine: LLMEngine) -> list[int]:
    """Cells in each layer's K array, lean runner or torch runner."""
    runner = engine.runner
    ks = runner.pool.k if hasattr(runner, "pool") else runner.kv.k  # type: ignore[attr-defined]
    return [int(k.shape[0]) * PAGE for k in ks]


@pytest.mark.parametrize("runner", RUNNERS)
def test_sliding_layers_hold_their_window_in_a_space_of_their_own(
    gemma: Path, runner: str, kept: dict[str, Run], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make(gemma, monkeypatch, runner=runner)
    space = engine.scheduler.cells.space
    size = window_space_cells(WINDOW, PAGE, 4, 24, CELLS)
    assert space is not None and size is not None and space.pool.n_cells == size < CELLS
    # the runner's arrays: the sliding layers' hold the window space's cells, the others all
    arch = engine.runner.weights.arch if runner == "lean" else engine.runner.loaded.arch  # type: ignore[attr-defined]
    for i, cells in enumerate(arrays(engine)):
        assert cells == (size if arch.window_of(i) is not None else CELLS)
    assert engine.max_model_len == CELLS  # the global layers keep the whole context
    got, peak = run(engine, {"long": LONG})
    assert len(got["long"]) == GREEDY.max_tokens
    assert got["long"] == kept[runner][0]["long"]  # bitwise: tokens and logprobs
    # what /props and /metrics report
    assert describe_props(engine.config, engine, engine.stats)["pool"]["window_cells"] == size
    metrics = {m.name: m.samples[0].value for m in EngineCollector(Scraped(engine)).collect()}
    assert metrics["kvpark_kv_window_cells_total"] == size
    # one sequence: its window and a step's rows (24), on pages that need not start aligned
    assert 0 < peak <= (-(-(WINDOW - 1 + 24) // PAGE) + 1) * PAGE


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("park", ["swap", "recompute"])
def test_parks_beside_others_change_no_bit(
    gemma: Path, runner: str, park: str, kept: dict[str, Run], monkeypatch: pytest.MonkeyPatch
) -> None:
    options: dict[str, object] = {"preempt_ram_mib": 0} if park == "recompute" else {}
    engine = make(gemma, monkeypatch, every=5, runner=runner, **options)
    others = {f"o{i}": t for i, t in enumerate(OTHERS)}
    got, peak = run(engine, {"long": LONG, **others})
    assert engine.stats.preemptions_total[park] > 0
    assert got["long"] == kept[runner][0]["long"]
    space = engine.scheduler.cells.space
    assert space is not None and peak <= space.pool.n_cells


def test_a_returning_conversation_hits_both_spaces(
    gemma: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make(gemma, monkeypatch)
    first, _ = run(engine, {"long": LONG, **{f"o{i}": t for i, t in enumerate(OTHERS)}})
    space = engine.scheduler.cells.space
    assert space is not None and space.pool.cells_cached() > 0
    ids = encode(engine, LONG) + [t.token_id for t in first["long"]]
    ids += encode(engine, " And the Seine?")
    warm, _ = run(engine, {"again": ids})
    # its window pages were found in the window space and its whole prefix in the pool
    assert engine.stats.prefix_cache_hits_total >= GREEDY.max_tokens
    cold, _ = run(make(gemma, monkeypatch, window_release=False), {"c": ids})
    assert warm["again"] == cold["c"]


def test_choices_fork_in_both_spaces(gemma: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=30, ignore_eos=True)

    def choices(engine: LLMEngine) -> dict[int, list[int]]:
        ids = encode(engine, LONG)
        engine.check_request(ids, params)
        engine.add_request("r", ids, params)
        got: dict[int, list[int]] = {}
        while engine.has_work:
            for events in engine.step().values():
                for ev in events:
                    if isinstance(ev, TokenEvent):
                        got.setdefault(ev.index, []).extend(ev.token_ids)
        assert engine.scheduler.pool.cells_used() == 0
        return got

    split = make(gemma, monkeypatch)
    assert split.scheduler.cells.space is not None
    slid = choices(split)
    assert sorted(slid) == [0, 1, 2] and all(len(t) == 30 for t in slid.values())
    assert slid == choices(make(gemma, monkeypatch, window_release=False))


class Scraped:
    """The engine as the metrics collector reads it (the server's AsyncEngine, one layer)."""

    ready = True

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def stats(self) -> EngineStats:
        return self.engine.stats

    def drain_observations(self) -> dict[str, list[float]]:
        return {}


def test_no_space_where_it_would_save_nothing(gemma: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sixteen slots of a window and two pages each, beside 512 rows a step, outgrow a pool of
    256 cells: the sliding layers share the pool's cells, as without window release."""
    engine = make(gemma, monkeypatch, parallel=16, max_batch_tokens=512)
    assert engine.scheduler.cells.space is None
    assert all(cells == CELLS for cells in arrays(engine))
    names = {m.name for m in EngineCollector(Scraped(engine)).collect()}
    assert "kvpark_kv_cells_total" in names and "kvpark_kv_window_cells_total" not in names


def test_tensor_parallel_ranks_keep_their_share_in_a_window_space(gemma: Path) -> None:
    """``--tensor-parallel 2`` (rank 1 a spawned gloo worker): every rank keeps its share of the
    sliding layers' K/V in the window space, bitwise the same TP size keeping every cell."""
    torch.set_num_threads(1)
    sched = SchedulerConfig(parallel=4, max_batch_tokens=24)

    def tokens(**pool: object) -> list[TokenLogprob]:
        config = tiny_tp.config(str(gemma), 2, kv_cells=CELLS, **pool)  # type: ignore[arg-type]
        engine = LLMEngine(replace(config, scheduler=sched))
        try:
            split = engine.scheduler.cells.space is not None
            assert split == config.pool.window_release
            if split:  # rank 0's share: the sliding layers' arrays are the window space's
                kv = engine.runner.shard.kv  # type: ignore[attr-defined]
                assert kv.split and min(k.shape[0] for k in kv.k) * kv.page_size < CELLS
            return run(engine, {"long": LONG})[0]["long"]
        finally:
            engine.close()

    slid = tokens()
    assert len(slid) == GREEDY.max_tokens
    assert slid == tokens(window_release=False)


def test_a_gguf_file_keeps_a_window_space_too(
    gemma: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The same model written as llama.cpp's converter writes it (Q8_0 matrices; its sliding
    pattern from the GGUF metadata), beside other requests with forced swaps: a window space,
    bitwise the file keeping every cell."""
    kind = gemma.name[:6]  # the fixture's folder: gemma2 or gemma3, and a counter
    metadata = GgufFile(default_model_path()).metadata
    model = save_arch(kind, Tokenizer.from_gguf_metadata(metadata), tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_gguf(kind, model, path, GGMLQuantizationType.Q8_0, metadata)
    kept, _ = run(make(path, monkeypatch, window_release=False), {"long": LONG})
    engine = make(path, monkeypatch, every=5)
    assert engine.scheduler.cells.space is not None
    got, _ = run(engine, {"long": LONG, **{f"o{i}": t for i, t in enumerate(OTHERS)}})
    assert engine.stats.preemptions_total["swap"] > 0
    assert got["long"] == kept["long"]
