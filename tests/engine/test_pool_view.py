"""The pool view's engine side (engine/pool_view.py, engine/pool_log.py) on a real engine with a
stand-in model: who owns each page (a request, several, the cache, nobody), the requests with their
sizes and parks and never their tokens, the timeline of parks, resumes and evictions, and the rule
that snapshots come only while watched, at most one per interval, and not of an unchanged engine.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import kvpark
from kvpark.config.layers import EngineConfig
from kvpark.engine.llm_engine import LLMEngine
from kvpark.engine.pool_view import CACHED, FREE, SHARED, PoolView, Snapshot
from kvpark.sampling.params import SamplingParams
from kvpark.sched.plan import StepPlan

PAGE = 16
SHARED_PREFIX = list(range(100, 100 + 2 * PAGE))  # two whole pages two prompts share
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


class ZeroRunner:
    """A stand-in model: greedy token 1 for every sampled row, no K/V; swaps copy nothing."""

    model_name = "zero"
    row_invariant = True
    max_model_len = 4096

    def __init__(self, tokenizer: kvpark.Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size

    def execute(self, plan: StepPlan) -> np.ndarray:
        logits = np.zeros((sum(item.sample for item in plan.items), self.vocab_size), np.float32)
        logits[:, 1] = 1.0
        return logits

    def bytes_per_cell(self) -> int:
        return 10

    def host_buffer(self, n_bytes: int) -> np.ndarray:
        return np.empty(n_bytes, dtype=np.uint8)

    def save_cells(self, cells: list[int], out: Any) -> None:
        pass

    def restore_cells(self, src: Any, cells: list[int]) -> None:
        pass


class Feed:
    """A stand-in hub: it records what it is given."""

    interval = 0.25

    def __init__(self) -> None:
        self.watching = True
        self.wanted = 0
        self.snapshots: list[Snapshot] = []

    def publish(self, snapshot: Snapshot) -> None:
        self.snapshots.append(snapshot)


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path: str) -> kvpark.Tokenizer:
    return kvpark.load_tokenizer(default_gguf_path)


def engine(tokenizer: kvpark.Tokenizer, kv_cells: int = 512, **options: Any) -> LLMEngine:
    config = EngineConfig.from_options(kv_cells=kv_cells, parallel=2, page_size=PAGE, **options)
    return LLMEngine(config, ZeroRunner(tokenizer))


def run(e: LLMEngine, steps: int) -> None:
    for _ in range(steps):
        e.step()


def test_owners_sizes_and_no_tokens(tokenizer: kvpark.Tokenizer) -> None:
    e = engine(tokenizer)
    e.add_request("first", [*SHARED_PREFIX, 7, 8, 9], LONG)
    run(e, 3)  # its prompt is in and registered: the second finds the shared pages
    e.add_request("second", [*SHARED_PREFIX, 5, 6], LONG)
    run(e, 3)
    snap = PoolView().take(e)
    owners = snap["owners"]
    assert isinstance(owners, list) and len(owners) == 512 // PAGE
    records = {r["id"]: r for r in snap["requests"]}  # type: ignore[attr-defined]
    first, second = records["first"], records["second"]
    assert owners.count(SHARED) == 2  # the prefix both hold
    assert owners.count(first["key"]) + 2 == first["pages"] == 3
    assert owners.count(second["key"]) + 2 == second["pages"] == 3
    assert owners.count(FREE) == len(owners) - 4
    assert second["cached_tokens"] == 2 * PAGE and first["cached_tokens"] == 0
    assert first["state"] == second["state"] == "decode"
    assert (first["prompt_tokens"], second["prompt_tokens"]) == (35, 34)
    assert second["cells"] == 34 + second["output_tokens"] - 1  # the newest token is not in yet
    assert str(SHARED_PREFIX[5]) not in json.dumps(snap["requests"])  # sizes, never tokens
    while e.has_work:
        e.step()
    after = PoolView().take(e)["owners"]
    assert isinstance(after, list) and set(after) <= {FREE, CACHED} and CACHED in after


def test_parks_and_resumes_go_on_the_timeline(
    tokenizer: kvpark.Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", "4")
    e = engine(tokenizer)
    view = PoolView()
    e.add_request("parked", [3, 4, 5, 6], LONG)
    for _ in range(20):  # 4 tokens out, then parked: it sits out one step
        e.step()
        if e.scheduler.parked:
            break
    snap = view.take(e)
    (record,) = snap["requests"]  # type: ignore[misc]
    assert (record["state"], record["mode"], record["cells"]) == ("parked", "swap", 0)
    assert record["host_bytes"] == 10 * 7  # its 7 cells, at the runner's 10 bytes a cell
    assert snap["owners"] == [FREE] * (512 // PAGE)  # a part page: freed, not cached
    while e.has_work:
        e.step()
    timeline = view.take(e)["timeline"]
    assert isinstance(timeline, list) and isinstance(snap["timeline"], list)
    entries = snap["timeline"] + timeline
    kinds = [(t["kind"], t.get("mode")) for t in entries]
    assert kinds[:2] == [("park", "swap"), ("resume", "swap")], kinds
    assert all(t["request"] == "parked" for t in entries)
    assert entries[0]["cells"] == 4 + 4 - 1  # prompt and output in the pool when it parked
    assert [t["n"] for t in entries] == sorted({t["n"] for t in entries})  # each once, in order
    assert view.take(e)["timeline"] == []  # a snapshot carries what is new since the last


def test_evictions_are_found_between_two_snapshots(tokenizer: kvpark.Tokenizer) -> None:
    e = engine(tokenizer, kv_cells=8 * PAGE)
    view = PoolView()
    e.add_request("old", list(range(10, 10 + 4 * PAGE + 1)), SamplingParams(max_tokens=1))
    while e.has_work:
        e.step()
    first = view.take(e)
    assert isinstance(first["owners"], list) and first["owners"].count(CACHED) == 4
    e.add_request("new", list(range(500, 500 + 7 * PAGE)), SamplingParams(max_tokens=1))
    while e.has_work:
        e.step()
    timeline = view.take(e)["timeline"]
    assert isinstance(timeline, list)
    evicted = [t["pages"] for t in timeline if t["kind"] == "evict"]
    assert evicted and 1 <= evicted[0] <= 4, timeline


def test_snapshots_only_while_watched_and_at_most_one_per_interval(
    tokenizer: kvpark.Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr("kvpark.engine.pool_view.time.monotonic", lambda: clock[0])
    e = engine(tokenizer)
    view, feed = PoolView(), Feed()
    feed.watching = False
    assert view.tick(e, feed) is None and view.tick(e, None) is None and not feed.snapshots
    feed.watching = True
    assert view.tick(e, feed) == feed.interval and len(feed.snapshots) == 1
    e.add_request("a", [1, 2, 3], LONG)
    e.step()
    clock[0] += 0.1
    assert view.tick(e, feed) == pytest.approx(0.15)  # not due yet, whatever changed
    clock[0] += 0.2
    view.tick(e, feed)
    assert len(feed.snapshots) == 2  # due, and the engine changed
    clock[0] += 1.0
    view.tick(e, feed)
    assert len(feed.snapshots) == 2  # due, but nothing changed
    feed.wanted += 1  # a new viewer wants the picture now
    view.tick(e, feed)
    assert len(feed.snapshots) == 3
    clock[0] += 1.0
    view.tick(e, feed)
    assert len(feed.snapshots) == 3  # once for it
