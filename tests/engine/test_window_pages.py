"""Pages behind a sliding window leave the pool (docs/models.md, "Pages"): on a tiny Mistral whose
every layer attends over its last 8 positions (tests/support/tiny_arch.py), a request several
times longer than the pool runs to the end holding at most its window and one step's rows, with
tokens and logprobs bitwise those of a pool that keeps every page (exact mode), on the lean runner
and the torch runner; forced swap and recompute parks and a warm prefix cache (the released pages
were registered first, so they wait in the cache) change no bit, and every cell comes back.
``--no-window-release`` keeps every page and caps the context at the pool.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvpark
from kvpark import SamplingParams
from kvpark.engine.llm_engine import LLMEngine
from kvpark.engine.outputs import TokenEvent, TokenLogprob
from kvpark.model.gguf_file import GgufFile
from kvpark.model.sources import default_model_path
from kvpark.tokenizer.tokenizer import Tokenizer
from support import tiny_tp
from support.tiny_arch import WINDOW, save_arch

PAGE = 4
SMALL = 32  # cells: far fewer than the long request's 150-odd positions
LONG = "Rivers of Europe: the Danube, the Rhine, the Elbe, the Loire and the Po. " * 4
OTHERS = ["Write a limerick about a cat.", "Explain recursion in two lines."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
RUNNERS = ["lean", "torch"]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("mistral")
    tokenizer = Tokenizer.from_gguf_metadata(GgufFile(default_model_path()).metadata)
    save_arch("mistral", tokenizer, root)
    yield root
    shutil.rmtree(root, ignore_errors=True)  # ~100 MB (the real vocabulary)


def make(
    root: Path, runner: str, monkeypatch: pytest.MonkeyPatch, every: int = 0, **options: object
) -> LLMEngine:
    torch.set_num_threads(1)
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", str(every))
    monkeypatch.setenv("KVPARK_PREEMPT_FAIL_SAVE", "0")
    options.setdefault("kv_cells", SMALL)
    llm = kvpark.LLM(
        model=str(root), runner=runner, exact=True, page_size=PAGE, threads=1, **options
    )
    return llm.engine


def encode(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run(
    engine: LLMEngine, texts: dict[str, str | list[int]]
) -> tuple[dict[str, list[TokenLogprob]], int]:
    """Every request (a text, or token ids) added at once and run to the end: each one's
    logprobs, and the most cells the pool held after any step."""
    for rid, text in texts.items():
        ids = text if isinstance(text, list) else encode(engine, text)
        engine.check_request(ids, GREEDY)
        engine.add_request(rid, ids, GREEDY)
    got: dict[str, list[TokenLogprob]] = {rid: [] for rid in texts}
    peak = 0
    while engine.has_work:
        for rid, events in engine.step().items():
            for ev in events:
                if isinstance(ev, TokenEvent) and ev.logprobs is not None:
                    got[rid].extend(ev.logprobs)
        peak = max(peak, engine.scheduler.pool.cells_used())
    assert engine.scheduler.pool.cells_used() == 0
    engine.scheduler.pool.check_integrity()
    return got, peak


@pytest.fixture(scope="module")
def kept(mistral: Path) -> dict[str, tuple[dict[str, list[TokenLogprob]], int]]:
    """Per runner: the long request alone on a pool that keeps every page."""
    mp = pytest.MonkeyPatch()
    try:
        return {
            r: run(make(mistral, r, mp, kv_cells=512, window_release=False), {"long": LONG})
            for r in RUNNERS
        }
    finally:
        mp.undo()


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_long_request_holds_its_window_not_its_context(
    mistral: Path, runner: str, kept: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make(mistral, runner, monkeypatch, max_batch_tokens=64)
    n_prompt = len(engine.tokenizer.encode(LONG, add_special_tokens=False))
    assert engine.max_model_len > SMALL  # the context is not capped at the pool
    got, peak = run(engine, {"long": LONG})
    want, kept_peak = kept[runner]
    assert len(got["long"]) == GREEDY.max_tokens
    assert got["long"] == want["long"]  # bitwise: tokens and logprobs
    # kept, it held every position but its last two (its last step finishes it and frees them)
    assert kept_peak >= n_prompt + GREEDY.max_tokens - 2
    cells = engine.scheduler.cells
    assert peak <= min(SMALL, cells.window_cells(cells.window_rows() or 0))
    assert engine.runner.kv_window == WINDOW


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("park", ["swap", "recompute"])
def test_parks_and_a_warm_prefix_cache_change_no_bit(
    mistral: Path, runner: str, park: str, kept: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    options: dict[str, object] = {"kv_cells": 64, "max_batch_tokens": 24}
    if park == "recompute":
        options["preempt_ram_mib"] = 0
    engine = make(mistral, runner, monkeypatch, every=5, **options)
    got, _ = run(engine, {"long": LONG, **{f"o{i}": t for i, t in enumerate(OTHERS)}})
    assert engine.stats.preemptions_total[park] > 0
    assert got["long"] == kept[runner][0]["long"]


@pytest.mark.parametrize("runner", RUNNERS)
def test_released_pages_are_cached_and_found_again(
    mistral: Path, runner: str, kept: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make(mistral, runner, monkeypatch, kv_cells=64, max_batch_tokens=24)
    assert engine.scheduler.pool.window == WINDOW
    # beside others, on a pool that holds a sixth of their positions: pages are evicted
    first, _ = run(engine, {"long": LONG, **{f"o{i}": t for i, t in enumerate(OTHERS)}})
    assert engine.scheduler.pool.cells_cached() > 0
    # the conversation returns: its prompt, the answer and a new message
    ids = encode(engine, LONG) + [t.token_id for t in first["long"]]
    ids += encode(engine, " And the Seine?")
    warm, _ = run(engine, {"again": ids})
    # found again: only the pages of the window before the hit are needed, and the cache keeps
    # them findable when the pages before them were evicted (the prompt's, long ago)
    assert engine.stats.prefix_cache_hits_total >= GREEDY.max_tokens
    cold, _ = run(
        make(mistral, runner, monkeypatch, kv_cells=512, window_release=False), {"c": ids}
    )
    assert warm["again"] == cold["c"]


def test_without_window_release_every_page_stays(
    mistral: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make(mistral, "lean", monkeypatch, window_release=False)
    assert engine.max_model_len == SMALL
    ids = engine.tokenizer.encode(LONG, add_special_tokens=False)
    with pytest.raises(kvpark.RequestRejected, match="maximum context length"):
        engine.check_request(ids, GREEDY)


def test_choices_of_one_prompt_share_its_pages_and_slide_apart(
    mistral: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``n = 3`` sampled choices fork after the prompt (sharing its pages, released ones
    included) and each gives back its own pages behind the window: their tokens are those of a
    pool that keeps every page."""
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
        engine.scheduler.pool.check_integrity()
        return got

    slid = choices(make(mistral, "lean", monkeypatch, kv_cells=64))  # a family cannot park
    assert sorted(slid) == [0, 1, 2] and all(len(t) == 30 for t in slid.values())
    assert slid == choices(make(mistral, "lean", monkeypatch, kv_cells=512, window_release=False))


def test_tensor_parallel_ranks_give_back_their_share_of_the_pages(mistral: Path) -> None:
    """``--tensor-parallel 2`` (rank 1 a spawned gloo worker, each rank its share of every cell):
    the long request on a pool half its length, bitwise the same TP size keeping every page."""
    torch.set_num_threads(1)

    def tokens(**pool: object) -> list[TokenLogprob]:
        engine = LLMEngine(tiny_tp.config(str(mistral), 2, **pool))  # type: ignore[arg-type]
        try:
            assert engine.runner.kv_window == WINDOW  # type: ignore[attr-defined]
            return run(engine, {"long": LONG})[0]["long"]
        finally:
            engine.close()

    slid = tokens(kv_cells=64)
    assert len(slid) == GREEDY.max_tokens
    assert slid == tokens(kv_cells=256, window_release=False)
