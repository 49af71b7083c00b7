"""Preemption acceptance tests on a real ``kvpark serve`` whose pool really fills (docs/server.md,
docs/preemption.md): parks come from the planner only. The pressure scenarios of the C++ original's
``test_preempt.py`` and ``test_preempt_notify.py`` in kvpark's own terms: a covering victim, a late
prompt parked in its prefill that rotates a resident out, keepalives, no overtaking, and clients
that hang up while parked. test_preempt_forced.py has the parks on schedule.

One server, started once for the module per policy:

- ``pressure`` (parametrized ``fcfs`` / ``cost``): 512 cells, 3 slots, 128-token steps,
  ``--sse-ping-interval 1``: a 32-page pool that really fills.

The streams, checks and layout in pages are support/preempt_server.py's; every scenario ends with
its ``settle``.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from support.preempt_server import (
    GENERATED,
    PAGE,
    POOL,
    PROMPT_TOKENS,
    RECOMPUTES,
    ROTATIONS,
    SAME_STEP_S,
    SCENARIO_TIMEOUT_S,
    SWAPS,
    Stream,
    Watcher,
    delta,
    flags,
    get,
    ids,
    paired,
    park_cells,
    parks_of,
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
    return str(request.param)


@pytest.fixture(scope="module")
def pressure(policy: str) -> Iterator[Server]:
    """A 32-page pool that really fills; parks come from the planner only."""
    more = ("--preempt-policy", policy, "--sse-ping-interval", "1")
    yield from serve_for_module(*flags(POOL, 3, 128, *more))


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


# ================================================================================= pressure


def test_props_report_the_policy(pressure: Server, policy: str) -> None:
    preempt = get(pressure, "/props")["preempt"]
    assert preempt["enabled"] is True and preempt["policy"] == policy
    assert get(pressure, "/props")["pool"] == {"kv_cells": POOL, "page_size": PAGE, "parallel": 3}


def test_two_generations_that_do_not_fit_together_both_finish(pressure: Server) -> None:
    # 200 + 60 tokens each: 17 pages alone, 34 of 32 together
    before = pressure.metrics()
    streams = [
        stream(pressure, {"prompt": ids(200, 1000 + 700 * i), "max_tokens": 60, "ignore_eos": True})
        for i in range(2)
    ]
    for s in streams:
        s.wait().assert_ok()
    parks = 0
    for s in streams:
        assert s.final["usage"]["completion_tokens"] == 60
        assert s.finish_reasons() == {0: "length"}
        k = paired(s.notices)
        assert s.final["preempt"] == {"parks": k, "recomputes": 0}
        parks += k
    assert parks >= 1, "precondition not met: nothing was parked"
    after = settle(pressure, before)
    assert delta(after, before, SWAPS) == parks
    assert delta(after, before, PROMPT_TOKENS) == 400


def test_the_covering_victim_is_parked_alone(pressure: Server, policy: str) -> None:
    """Three residents of 8, 80 and 440 prompt tokens in one request (so they start in one step).
    The 440-token prompt's fourth 126-row chunk asks for 8 pages with 26 of 32 held: 3 pages
    short. ``cost`` parks the one resident whose cells cover that with the fewest cells: the
    80-token prompt (6 pages; the 8-token one frees 1 page, too few). ``fcfs`` parks the newest,
    the 440-token prompt. Either way one park makes room."""
    before = pressure.metrics()
    body = {"prompt": [ids(8), ids(80, 2000), ids(440, 3000)], "max_tokens": 24}
    s = stream(pressure, {**body, "ignore_eos": True}).wait()
    s.assert_ok()
    expected = "1" if policy == "cost" else "2"
    (parked_at, first), *later = s.timed_notices
    assert first == f": preempted {expected}", s.notices
    # one park made room: nobody else was parked in that step. A step's notices go out in one
    # burst, milliseconds apart; the next step (a 126-row chunk at least) comes tens of ms later,
    # and may park again for pressure of its own (a rotation comes >= 2 s later)
    assert not [n for t, n in later if t - parked_at < SAME_STEP_S and n.startswith(": preempted")]
    request_id = s.data[0]["id"]
    log = pressure.log()
    first_park = re.search(rf"preempted request {re.escape(request_id)}-(\d) by swap", log)
    assert first_park is not None and first_park.group(1) == expected
    assert s.finish_reasons() == {0: "length", 1: "length", 2: "length"}
    assert s.final["usage"] == {
        "prompt_tokens": 528,
        "completion_tokens": 72,
        "total_tokens": 600,
        "prompt_tokens_details": {"cached_tokens": 0},  # the cache is off on these servers
    }
    assert s.final["preempt"]["parks"] == sum(n.startswith(": preempted") for n in s.notices)
    settle(pressure, before)


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


# ================================================================================= cancel


def parked_slot(server: Server, n_prompt: int) -> bool:
    return any(
        s["is_preempted"] and s["n_prompt_tokens"] == n_prompt for s in get(server, "/slots")
    )


@pytest.mark.parametrize("policy", ["fcfs"], indirect=True)
def test_cancelling_a_parked_stream_gives_its_slot_and_parked_bytes_back(pressure: Server) -> None:
    """The resident is an ``n = 2`` family (never a victim, never rotated out), so the late prompt
    stays parked, in its prefill, until its client hangs up."""
    before = pressure.metrics()
    body = {"prompt": ids(300), "n": 2, "max_tokens": 100, "ignore_eos": True}
    resident = stream(pressure, body)
    wait_until("the resident decodes", lambda: len(resident.data) >= 4)
    late = stream(pressure, {"prompt": ids(200, 5000), "max_tokens": 16, "ignore_eos": True})
    wait_until("the late prompt is parked", lambda: parked_slot(pressure, 200))
    held = pressure.metrics()
    assert held["kvpark_preempt_ram_bytes"] > 0 and held["kvpark_requests_preempted"] == 1
    late.close()
    # its slot and its parked bytes come back while the resident goes on
    wait_until(
        "the cancelled request's slot is free",
        lambda: all(s["n_prompt_tokens"] != 200 for s in get(pressure, "/slots")),
        timeout=30,
    )
    m = pressure.metrics()
    assert m["kvpark_preempt_ram_bytes"] == 0
    assert m["kvpark_requests_preempted"] == 0
    assert m["kvpark_kv_cells_used"] > 0  # the resident's
    assert late.notices == [": preempted"] and not late.data
    assert not resident.done.is_set(), "precondition not met: the resident already finished"
    resident.close()
    after = settle(pressure, before, unresumed=1)
    assert parks_of(after) - parks_of(before) == 1
    assert delta(after, before, ROTATIONS) == 0


@pytest.mark.parametrize("policy", ["fcfs"], indirect=True)
def test_cancelling_a_multi_prompt_stream_with_a_parked_prompt_leaves_nothing_parked(
    pressure: Server,
) -> None:
    """300 + 200 prompt tokens in one request: the second prompt's prefill does not fit, so it
    is parked; the client hangs up. Both prompts are aborted together, and once every slot is
    free nothing may still count as parked."""
    before = pressure.metrics()
    body = {"prompt": [ids(300), ids(200, 5000)], "max_tokens": 60, "ignore_eos": True}
    s = stream(pressure, body)
    wait_until("a prompt is parked", lambda: any(n.startswith(": preempted") for n in s.notices))
    wait_until("/slots shows it", lambda: any(x["is_preempted"] for x in get(pressure, "/slots")))
    parked = sum(1 for x in get(pressure, "/slots") if x["is_preempted"])
    s.close()
    settle(pressure, before, unresumed=parked)
