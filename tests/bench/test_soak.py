"""kvpark bench --scenario soak: the plan covers every kind at 60+ requests, the judge fails what
it must, and one real run (two real ``python -m kvpark serve`` processes) passes every check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvpark.bench.soak.client import Outcome
from kvpark.bench.soak.judge import fate
from kvpark.bench.soak.plan import BAD, BAD_KINDS, DISCONNECT, GOOD, build_plan
from kvpark.bench.soak.probe import FAULT_MESSAGE
from support.servers import free_port


def test_a_plan_of_60_has_every_kind_and_is_seeded() -> None:
    plan = build_plan(0, 60, "default", 32)
    assert len(plan.requests) == 60
    assert {r.bad for r in plan.requests if r.kind == BAD} == set(BAD_KINDS)
    assert any(r.kind == DISCONNECT for r in plan.requests)
    assert any(len(entry) >= 10 for entry in plan.entries)  # a burst of disconnects
    again = build_plan(0, 60, "default", 32)
    assert [r.body for r in again.requests] == [r.body for r in plan.requests]
    assert [r.body for r in build_plan(1, 60, "default", 32).requests] != [
        r.body for r in plan.requests
    ]


def test_the_judge_tells_a_match_from_a_mismatch_and_a_provoked_500_from_another() -> None:
    good = next(r for r in build_plan(0, 60, "default", 32).requests if r.kind == GOOD)
    out = Outcome(good.index, status=200, texts={0: "hi"}, finish={0: "stop"}, done=True)
    assert fate(good, out, out.answer()) == "match"
    assert fate(good, out, {**out.answer(), "completion_tokens": 3}) == "mismatch"
    faulted = Outcome(good.index, status=500, error={"message": FAULT_MESSAGE, "code": 500})
    assert fate(good, faulted, out.answer()) == "faulted"
    other = Outcome(good.index, status=500, error={"message": "boom", "code": 500})
    assert fate(good, other, out.answer()) == "unprovoked_error"


def test_a_soak_of_64_requests_passes_every_check(tmp_path: Path) -> None:
    """The smallest pool that holds the plan's longest request alone, and twelve requests in
    flight for the eight slots: 64 requests must still put the pool under pressure (parks) on a
    fast machine, where the default 512 cells and eight in flight peaked at 480 used and parked
    nothing once the kernels got faster."""
    cells = str(build_plan(0, 64, "default", 32).max_cells())
    run = subprocess.run(
        [sys.executable, "-m", "kvpark", "bench", "--scenario", "soak", "--requests", "64",
         "--threads", "2", "--port", str(free_port()), "--out", str(tmp_path),
         "--kv-cells", cells, "--concurrency", "12"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    doc = json.loads((tmp_path / "soak.json").read_text())
    verdict = doc["verdict"]
    assert verdict["passed"] and all(c["ok"] for c in verdict["checks"])
    assert all(count > 0 for count in verdict["categories"].values()), verdict["categories"]
    assert {"match", "refused", "hung_up", "faulted"} <= set(verdict["fates"])
    assert doc["requests"]["ran"] == 64
    assert (tmp_path / "soak.png").stat().st_size > 0
