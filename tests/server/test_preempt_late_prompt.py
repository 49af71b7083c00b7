"""Preemption acceptance on a real ``kvpark serve`` whose pool really fills (docs/server.md,
docs/preemption.md): a late prompt parked in its prefill, before its first token, by either policy,
that waits the planner's 2 s and then rotates the generating resident out. Both finish with the
prompt counted once; the parked stream opens with its notice and gets keepalives; short requests
do not overtake it; /slots and /metrics show it parked. test_preempt_pressure.py has the other
pressure scenarios.

One server, started once for the module per policy:

- ``slow_pressure`` (parametrized ``fcfs`` / ``cost``): the ``pressure`` pool of
  test_preempt_pressure.py (512 cells, 3 slots, 128-token steps, ``--sse-ping-interval 1``) on the
  torch runner, dense float32 weights and one thread.

The streams, checks and layout in pages are support/preempt_server.py's; the scenario ends with
its ``settle``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from support.preempt_server import (
    GENERATED,
    POOL,
    PROMPT_TOKENS,
    RECOMPUTES,
    ROTATIONS,
    SCENARIO_TIMEOUT_S,
    SWAPS,
    Stream,
    Watcher,
    delta,
    flags,
    ids,
    paired,
    park_cells,
    post,
    settle,
    stream,
    wait_until,
)
from support.servers import Server, serve_for_module

# --------------------------------------------------------------------------------- servers


@pytest.fixture(scope="module", params=["fcfs", "cost"])
def policy(request: pytest.FixtureRequest) -> str:
    """The ``pressure`` server's --preempt-policy."""
    """The ``slow_pressure`` server's --preempt-policy."""
    return str(request.param)


@pytest.fixture(scope="module")
def slow_pressure(policy: str) -> Iterator[Server]:
    """The same pool on the slowest built-in path: the torch runner on dense float32 weights, one
    thread (~27 tok/s on a 2-core EPYC). The rotation scenario needs its resident still decoding
    when the late prompt has waited the planner's 2 s (``rotate_after_ms``): the native decoder
    (~150 tok/s) finished the resident's last 146 tokens in about one, the torch runner on the
    blocks (~77) in about two, and no rotation was due."""
    slow = ("--runner", "torch", "--threads", "1", "--weights", "dense", "--dtype", "float32")
    more = ("--preempt-policy", policy, "--sse-ping-interval", "1", *slow)
    yield from serve_for_module(*flags(POOL, 3, 128, *more))


# ================================================================================= late prompt


@dataclass
class LateRun:
    """A resident generating 150 tokens after a 300-token prompt, a 200-token prompt sent once it
    decodes, and short requests sent while that late prompt is parked."""

    resident: Stream
    late: Stream
    shorts: list[tuple[float, float, int]]  # sent, answered, status
    watcher: Watcher
    before: dict[str, float]
    after: dict[str, float]
    log: str


SHORT_PROMPT = 4


@pytest.fixture(scope="module")
def late_run(slow_pressure: Server) -> LateRun:
    """The resident holds 19-20 pages when the late prompt arrives; its first 127-row chunk fits
    (8 pages), its second (5 more) does not: it is parked in its prefill, before its first token,
    by either policy (``cost``: it holds fewer cells than the resident). It waits 2 s, then
    rotates the resident out; short requests keep arriving meanwhile."""
    before = slow_pressure.metrics()
    with Watcher(slow_pressure) as watcher:
        resident = stream(
            slow_pressure, {"prompt": ids(300), "max_tokens": 150, "ignore_eos": True}
        )
        wait_until(
            "the resident decodes", lambda: len(resident.data) >= 4 or resident.done.is_set()
        )
        late = stream(
            slow_pressure, {"prompt": ids(200, 5000), "max_tokens": 16, "ignore_eos": True}
        )
        wait_until("the late prompt is parked", lambda: bool(late.notices) or late.done.is_set())
        assert late.notices[:1] == [": preempted"], "precondition not met: nothing was parked"
        shorts: list[tuple[float, float, int]] = []

        def short(sent: float) -> None:
            body = {"prompt": ids(SHORT_PROMPT, 9000), "max_tokens": 2, "ignore_eos": True}
            r = post(slow_pressure, "/v1/completions", body)
            shorts.append((sent, time.monotonic(), r.status_code))

        senders = []
        for _ in range(16):  # a stream of short requests while the late prompt waits
            if late.done.is_set():
                break
            sender = threading.Thread(target=short, args=(time.monotonic(),), daemon=True)
            sender.start()
            senders.append(sender)
            late.done.wait(0.5)
        late.wait()
        resident.wait()
        for sender in senders:
            sender.join(SCENARIO_TIMEOUT_S)
    after = settle(slow_pressure, before)
    return LateRun(resident, late, shorts, watcher, before, after, slow_pressure.log())


def test_a_late_prompt_and_a_generating_request_both_finish_counting_the_prompt_once(
    late_run: LateRun,
) -> None:
    r = late_run
    r.resident.assert_ok()
    r.late.assert_ok()
    assert r.resident.final["usage"]["completion_tokens"] == 150
    assert r.late.final["usage"]["completion_tokens"] == 16
    assert r.resident.final["usage"]["prompt_tokens"] == 300
    assert r.late.final["usage"]["prompt_tokens"] == 200
    assert r.late.final["timings"]["prompt_n"] == 200
    # the replayed or restarted prompt is not counted again
    prompts = 300 + 200 + SHORT_PROMPT * len(r.shorts)
    assert delta(r.after, r.before, PROMPT_TOKENS) == prompts
    assert delta(r.after, r.before, GENERATED) == 150 + 16 + 2 * len(r.shorts)
    parks = paired(r.resident.notices) + paired(r.late.notices)
    assert r.resident.final["preempt"]["parks"] + r.late.final["preempt"]["parks"] == parks
    assert delta(r.after, r.before, SWAPS) == parks
    assert delta(r.after, r.before, RECOMPUTES) == 0


def test_a_stream_parked_in_its_prefill_opens_with_the_notice(late_run: LateRun) -> None:
    late = late_run.late
    parked_at = late.first(": preempted")
    opening = [line for t, line in late.lines if t < parked_at]
    # Its first bytes are the notice: no ping opens a stream, even with --sse-ping-interval 1
    assert opening == [], late.lines[:4]
    # the notice arrives on its own, well before the first token
    assert late.first_data_at - parked_at >= 0.05
    assert late.notices[:2] == [": preempted", ": resumed"]
    # parked in its prefill: some, not all, of its 200 prompt cells were computed
    cells = park_cells(late_run.log, late.data[0]["id"])
    assert cells and 0 < cells[0] < 200, cells
    parked = [s for s in late_run.watcher.parked() if s["n_prompt_tokens"] == 200]
    assert parked, "no /slots snapshot showed the late prompt parked"
    assert parked[0]["n_decoded"] == 0 and parked[0]["n_cells"] == 0


def test_a_head_parked_for_long_takes_the_place_of_a_resident(late_run: LateRun) -> None:
    r = late_run
    assert delta(r.after, r.before, ROTATIONS) >= 1
    resident_id = r.resident.data[0]["id"]
    assert f"rotated out request {resident_id}" in r.log
    # the resident was parked for the head, after the head had waited about 2 s
    head_parked = r.late.first(": preempted")
    head_resumed = r.late.first(": resumed")
    assert head_resumed - head_parked >= 1.5
    assert r.resident.notices and r.resident.first(": preempted") >= head_parked
    assert r.resident.lines[-1][0] > head_resumed  # it was still running: not a finish


def test_a_parked_stream_gets_keepalives(late_run: LateRun) -> None:
    late = late_run.late
    parked_at, resumed_at = late.first(": preempted"), late.first(": resumed")
    while_parked = [line for t, line in late.comments if parked_at < t < resumed_at]
    assert ": preempt-keepalive" in while_parked, while_parked
    # every ping of a parked stream is the keepalive
    assert ":" not in while_parked, while_parked


def test_a_parked_head_is_not_overtaken_by_short_requests(late_run: LateRun) -> None:
    r = late_run
    resumed_at = r.late.first(": resumed")
    after_park = [s for s in r.shorts if s[0] > r.late.first(": preempted")]
    assert len(after_park) >= 2, "precondition not met: short requests did not keep arriving"
    assert all(status == 200 for _, _, status in r.shorts)
    # none of them was served while the head waited
    assert all(answered > resumed_at for _, answered, _ in after_park)


def test_slots_and_metrics_show_the_parked_request(late_run: LateRun) -> None:
    r = late_run
    r.watcher.check_invariants()
    assert r.watcher.parked(), "no /slots snapshot showed a parked slot"
    assert all(s["n_recompute"] == 0 for s in r.watcher.parked())  # swaps only
    assert any(m["kvpark_requests_preempted"] >= 1 for m in r.watcher.gauges)
    assert any(m["kvpark_preempt_ram_bytes"] > 0 for m in r.watcher.gauges)
