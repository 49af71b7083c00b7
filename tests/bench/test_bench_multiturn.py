"""``kvpark bench --scenario multiturn`` against a real ``kvpark serve`` on the default model: each
turn sends the history with the server's own answers, and the prefix cache's share is recorded
per turn (issue 13 part 5)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpark.bench import main
from support.servers import Server, serve_for_module

TURNS = 3


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module()


def test_a_multiturn_run_records_what_the_cache_served(server: Server, tmp_path: Path) -> None:
    argv = ["--url", server.base_url, "--label", "kvpark", "--scenario", "multiturn"]
    argv += ["--concurrency", "2", "--turns", str(TURNS), "--prompt-tokens", "80"]
    argv += ["--max-tokens", "8", "--out", str(tmp_path), "--name", "mt"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "mt.json").read_text())
    (run,) = doc["runs"]
    (summary,) = run["extra"]["multiturn"]
    assert summary["completed"] and summary["errors"] == 0 and summary["reports_cache"]
    records = sorted(run["requests"]["2"], key=lambda r: r["index"])
    for conv in range(2):
        turns = records[conv * TURNS : (conv + 1) * TURNS]
        prompts = [r["prompt_tokens"] for r in turns]
        assert prompts == sorted(prompts) and len(set(prompts)) == TURNS  # the history grows
        # from the second turn on, at least the turn before's prompt (whole pages) is cached
        for before, now in itertools.pairwise(turns):
            assert now["cached_tokens"] >= before["prompt_tokens"] // 16 * 16
    per_turn = summary["per_turn"]
    assert [t["turn"] for t in per_turn] == list(range(1, TURNS + 1))
    assert summary["prompt_tokens_computed"] == sum(t["computed"] for t in per_turn)
    assert 0 < summary["cache_share"] < 1
    assert summary["ttft_p50_turns_3_on_s"] is not None
