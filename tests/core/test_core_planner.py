"""The planner's Python contract (kvpark._core.Planner, RequestView, Action, round_up_buffer).

The rules themselves are tested in Rust (rust/tests/planner_cases.rs, planner_props.rs); this
checks the binding: constructors, fields, errors, and a few scenarios end to end.
"""

from __future__ import annotations

from typing import Literal

import pytest

from kvpark._core import Action, KvPool, Planner, RequestView, round_up_buffer

KIB = 1024
Mode = Literal["swap", "recompute"]


def pool_with(n_cells: int, page_size: int, seqs: dict[int, int]) -> KvPool:
    pool = KvPool(n_cells, page_size)
    for seq, cells in seqs.items():
        pool.add_sequence(seq)
        pool.reserve(seq, cells)
    return pool


def running(
    request_id: int,
    arrival: int,
    seq: int,
    next_cells: int,
    state_bytes: int = 0,
    resumed_at_ms: int | None = None,
    tokens_since_resume: int = 0,
) -> RequestView:
    return RequestView(
        id=request_id,
        arrival=arrival,
        seq_ids=[seq],
        next_cells=[(seq, next_cells)],
        slot=seq,
        state_bytes=state_bytes,
        resumed_at_ms=resumed_at_ms,
        tokens_since_resume=tokens_since_resume,
    )


def summary(actions: list[Action]) -> list[tuple[object, ...]]:
    return [(a.kind, a.request, a.mode, a.buffer_capacity, a.slot, a.head) for a in actions]


def three_crossing() -> tuple[KvPool, list[RequestView]]:
    """One page each in a 4-page pool, each about to cross into a second page; ids run
    against arrival."""
    pool = pool_with(64, 16, {1: 16, 2: 16, 3: 16})
    return pool, [running(30, 1, 1, 17), running(20, 2, 2, 17), running(10, 3, 3, 17)]


def test_planner_settings_and_their_errors() -> None:
    planner = Planner()
    assert planner.policy == "fcfs"
    assert planner.margin_cells == 8
    assert planner.ram_budget_bytes == -1
    assert (planner.rotate_after_ms, planner.rotate_min_tokens, planner.rotate_min_ms) == (
        2000,
        32,
        2000,
    )
    assert planner.starved_parks == 3 and planner.park_ahead
    assert "fcfs" in repr(planner)
    assert Planner("cost", ram_budget_bytes=0).ram_budget_bytes == 0
    with pytest.raises(ValueError, match="policy"):
        Planner("lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget"):
        Planner(ram_budget_bytes=-2)


def test_request_view_fields_and_their_errors() -> None:
    view = RequestView(id=7, arrival=3, state="parked", mode="swap", resume_cells=40, slot=2)
    assert (view.id, view.arrival, view.state, view.mode) == (7, 3, "parked", "swap")
    assert (view.resume_cells, view.slot, view.seq_ids, view.next_cells) == (40, 2, [], [])
    assert view.parked_at_ms is None and not view.family and not view.refused
    assert "parked" in repr(view)
    default = RequestView(id=1, arrival=1)
    assert (default.state, default.mode) == ("running", None)
    with pytest.raises(AttributeError):
        view.id = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        RequestView(7, 3)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="needs its mode"):
        RequestView(id=1, arrival=1, state="parked")
    with pytest.raises(ValueError, match="only for a parked"):
        RequestView(id=1, arrival=1, mode="swap")
    with pytest.raises(ValueError, match="state"):
        RequestView(id=1, arrival=1, state="gone")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="park mode"):
        RequestView(id=1, arrival=1, state="parked", mode="drop")  # type: ignore[arg-type]


def test_fcfs_parks_the_newest_until_the_step_fits() -> None:
    pool, reqs = three_crossing()
    actions = Planner(ram_budget_bytes=0).plan(pool, reqs, [], 0)
    assert summary(actions) == [
        ("park", 10, "recompute", 0, None, None),
        ("park", 20, "recompute", 0, None, None),
    ]
    assert "kind='park'" in repr(actions[0])
    assert actions[0] == Planner(ram_budget_bytes=0).plan(pool, reqs, [], 0)[0]
    assert actions[0] != actions[1]


def test_cost_parks_the_one_victim_that_covers_the_shortfall() -> None:
    pool = pool_with(2408, 4, {1: 300, 2: 1500, 3: 600})
    reqs = [running(1, 1, 1, 300), running(2, 2, 2, 1500), running(3, 3, 3, 600)]
    planner = Planner("cost", margin_cells=8 + 1400, ram_budget_bytes=0)  # 1400 cells short
    assert summary(planner.plan(pool, reqs, [], 0)) == [("park", 2, "recompute", 0, None, None)]


def test_a_swap_gives_idle_buffers_back_largest_first() -> None:
    pool, reqs = three_crossing()
    # Slot 0 holds a swapped state (busy), slot 2 is the victim's own, slots 4-6 are idle.
    swapped = RequestView(id=40, arrival=0, state="parked", mode="swap", resume_cells=16, slot=0)
    reqs = [reqs[0], running(20, 2, 2, 17, state_bytes=256 * KIB), swapped]
    buffers = [512 * KIB, 0, 64 * KIB, 0, 128 * KIB, 256 * KIB, 192 * KIB]
    # 1152 KiB held + 192 KiB more for the victim > 1024 KiB: give back 256 then 192 KiB.
    planner = Planner(margin_cells=48, ram_budget_bytes=1024 * KIB)
    actions = planner.plan(pool, reqs, buffers, 0)
    assert summary(actions) == [
        ("release_buffer", None, None, 0, 5, None),
        ("release_buffer", None, None, 0, 6, None),
        ("park", 20, "swap", 256 * KIB, None, None),
    ]


def parked(
    request_id: int, arrival: int, resume_cells: int, mode: Mode = "recompute", at: int = 0
) -> RequestView:
    return RequestView(
        id=request_id,
        arrival=arrival,
        state="parked",
        mode=mode,
        resume_cells=resume_cells,
        parked_at_ms=at,
        slot=request_id,
    )


def test_resume_is_head_of_line() -> None:
    pool = pool_with(128, 16, {9: 32})
    reqs = [running(9, 9, 9, 32), parked(1, 1, 90), parked(2, 2, 16, "swap")]
    # The head needs 96 cells: 32 + 96 + 16 > 128. The one behind would fit but does not pass.
    assert Planner().plan(pool, reqs, [], 1000) == []
    pool.free_sequence(9)
    actions = Planner().plan(pool, reqs[1:], [], 1000)
    assert summary(actions) == [
        ("resume", 1, None, 0, None, None),
        ("resume", 2, None, 0, None, None),
    ]


def test_the_margin_is_waived_when_nothing_is_resident() -> None:
    pool = KvPool(256, 16)
    reqs = [parked(1, 1, 250), parked(2, 2, 250)]
    # 256 + a 16-cell margin > 256: let in only because nobody is resident; the second is not.
    assert summary(Planner().plan(pool, reqs, [], 0)) == [("resume", 1, None, 0, None, None)]


def test_a_head_parked_two_seconds_rotates_a_resident_out() -> None:
    pool = pool_with(256, 16, {1: 64, 2: 96})
    reqs = [
        RequestView(
            id=7, arrival=1, state="parked", mode="recompute", resume_cells=120, parked_at_ms=0
        ),
        running(5, 2, 1, 64),
        running(6, 3, 2, 96, resumed_at_ms=1000, tokens_since_resume=3),
    ]
    planner = Planner(ram_budget_bytes=0)
    assert planner.plan(pool, reqs, [], 1999) == []
    assert summary(planner.plan(pool, reqs, [], 2000)) == [("rotate", 5, "recompute", 0, None, 7)]


def test_choose_victims_covers_a_failed_step() -> None:
    pool, reqs = three_crossing()
    planner = Planner(ram_budget_bytes=0, park_ahead=False)
    assert planner.plan(pool, reqs, [], 0) == []
    assert [a.request for a in planner.choose_victims(pool, reqs, [], 33)] == [10, 20]
    assert planner.choose_victims(pool, reqs, [], 0) == []


def test_fail_for_a_request_that_cannot_fit_even_an_empty_pool() -> None:
    pool = pool_with(64, 16, {1: 64})
    actions = Planner().plan(pool, [running(1, 1, 1, 65)], [], 0)
    assert summary(actions) == [("fail", 1, None, 0, None, None)]


def test_a_bad_snapshot_raises() -> None:
    pool, reqs = three_crossing()
    planner = Planner()
    with pytest.raises(KeyError, match="unknown sequence 42"):
        planner.plan(pool, [*reqs, running(11, 9, 42, 1)], [], 0)
    with pytest.raises(ValueError, match="request 10 is twice"):
        planner.plan(pool, [*reqs, RequestView(id=10, arrival=9, slot=9)], [], 0)
    with pytest.raises(ValueError, match="slot 1"):
        planner.plan(pool, [*reqs, RequestView(id=11, arrival=9, slot=1)], [], 0)


def test_round_up_buffer() -> None:
    assert round_up_buffer(100 * KIB, 0, 0, -1) == 128 * KIB
    assert round_up_buffer(600 * KIB, 512 * KIB, 512 * KIB, -1) == 768 * KIB
    assert round_up_buffer(600 * KIB, 512 * KIB, 512 * KIB, 1024 * KIB) == 640 * KIB
    assert round_up_buffer(300 * KIB, 512 * KIB, 512 * KIB, 0) == 512 * KIB
    with pytest.raises(ValueError):
        round_up_buffer(1, 0, 0, -5)


def test_two_requests_that_do_not_fit_together_both_finish() -> None:
    """A minimal engine loop: two requests of 8 + 160 tokens in a 256-cell pool, 20 ms a step."""
    pool = KvPool(256, 16)
    planner = Planner(ram_budget_bytes=0)
    done = 8 + 160
    tokens = {1: 8, 2: 8}  # known tokens; all but the last are computed between steps
    parked_at: dict[int, int] = {}
    parks = 0
    for seq in tokens:
        pool.add_sequence(seq)
    for step in range(2000):
        now = step * 20
        live = [s for s in tokens if tokens[s] < done]
        if not live:
            break
        views = [
            parked(s, s, tokens[s], at=parked_at[s])
            if s in parked_at
            else running(s, s, s, tokens[s])
            for s in live
        ]
        for action in planner.plan(pool, views, [], now):
            assert action.request is not None
            if action.kind in ("park", "rotate"):
                pool.free_sequence(action.request)
                parked_at[action.request] = now
                parks += 1
            if action.kind in ("resume", "rotate"):
                back = action.head if action.kind == "rotate" else action.request
                assert back is not None
                pool.add_sequence(back)
                del parked_at[back]
            assert action.kind in ("park", "resume", "rotate"), action
        for s in live:
            if s not in parked_at:
                pool.reserve(s, tokens[s])  # the first step back replays every token
                tokens[s] += 1
                if tokens[s] == done:
                    pool.free_sequence(s)
        pool.check_integrity()
    assert all(t == done for t in tokens.values())
    assert parks >= 1
    assert pool.cells_used() == 0
