"""Preemption acceptance tests on a real ``kvpark serve`` whose pool really fills (docs/server.md,
docs/preemption.md): parks come from the planner only. The pressure scenarios of the C++ original's
``test_preempt.py`` and ``test_preempt_notify.py`` in kvpark's own terms: two generations that do
not fit together, a covering victim, and clients that hang up while parked.
test_preempt_late_prompt.py has the late prompt parked in its prefill that rotates a resident out;
test_preempt_forced.py has the parks on schedule.

One server, started once for the module per policy:

- ``pressure`` (parametrized ``fcfs`` / ``cost``): 512 cells, 3 slots, 128-token steps,
  ``--sse-ping-interval 0.2`` (a hang-up is seen within it): a 32-page pool that really fills.

The streams, checks and layout in pages are support/preempt_server.py's; every scenario ends with
its ``settle``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from support.preempt_server import (
    PAGE,
    POOL,
    PROMPT_TOKENS,
    ROTATIONS,
    SAME_STEP_S,
    SWAPS,
    delta,
    flags,
    get,
    ids,
    paired,
    parks_of,
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
    more = ("--preempt-policy", policy, "--sse-ping-interval", "0.2")
    yield from serve_for_module(*flags(POOL, 3, 128, *more))


# ================================================================================= pressure


def test_props_report_the_policy(pressure: Server, policy: str) -> None:
    preempt = get(pressure, "/props")["preempt"]
    assert preempt["enabled"] is True and preempt["policy"] == policy
    assert get(pressure, "/props")["pool"] == {
        "kv_cells": POOL,
        "page_size": PAGE,
        "parallel": 3,
        "window_cells": None,
    }


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
    # the resident's 100 tokens take about a second on a fast machine, and the server sees the
    # hang-up at its next ping (within 0.2 s): it may have finished by now, with every cell back
    resident_done = resident.done.is_set()
    m = pressure.metrics()
    assert m["kvpark_preempt_ram_bytes"] == 0
    assert m["kvpark_requests_preempted"] == 0
    if resident_done:
        assert m["kvpark_kv_cells_used"] == 0
    else:  # the resident's, unless it finished between the two reads
        assert m["kvpark_kv_cells_used"] > 0 or resident.done.wait(5)
    # parked until it was cancelled: never resumed, never a token
    assert late.notices == [": preempted"] and not late.data
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
