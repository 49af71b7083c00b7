"""``n > 1`` families never park once forked, so admission keeps room for every running family to
reach its most cells at once (``StepCells.family_room``): two that outgrew the pool together
would stall each other until the scheduler failed one."""

from __future__ import annotations

import pytest

from support.sched_steps import advance, finish_done, make, request


@pytest.mark.parametrize(
    ("prompt_len", "n", "max_tokens"),
    [(20, 3, 15), (32, 2, 16), (5, 2, 40), (47, 3, 1), (16, 4, 17)],
)
def test_a_family_never_holds_more_than_its_most_cells(
    prompt_len: int, n: int, max_tokens: int
) -> None:
    sched = make(kv_cells=512, page_size=16, parallel=4, budget=64)
    sched.add(request("a", prompt_len, n=n, max_tokens=max_tokens))
    most = sched.cells.family_cells(prompt_len, n, max_tokens, 64)
    peak = 0
    while sched.has_work:
        plan, outcome = sched.schedule()
        assert outcome.failed == []
        peak = max(peak, sched.pool.cells_used())
        advance(sched, plan)
        finish_done(sched)
    # tight: only a family of one token each ends at its first draw, before the copies
    assert peak == most if max_tokens > 1 else peak < most
    assert sched.pool.cells_used() == 0


def test_families_that_outgrow_the_pool_together_run_one_after_the_other() -> None:
    # 8 pages of 16: each family (a 20-token prompt, 2 choices of 40 tokens) reaches 7 pages,
    # its prompt's full page and 3 of each choice's own; admitted together (as they were before
    # the rule), both stalled at 8 pages and b failed
    sched = make(kv_cells=128, page_size=16, parallel=4, budget=64)
    assert sched.cells.family_cells(20, 2, 40, 64) == 112
    sched.add(request("a", 20, n=2, max_tokens=40))
    sched.add(request("b", 20, n=2, max_tokens=40))
    done: list[str] = []
    admitted_b_with_a = False
    while sched.has_work:
        plan, outcome = sched.schedule()
        assert outcome.failed == []
        ids = {r.request_id for r in sched.running}
        admitted_b_with_a |= ids == {"a", "b"}
        advance(sched, plan)
        done += finish_done(sched)
        sched.pool.check_integrity()
    assert done == ["a", "b"]
    assert not admitted_b_with_a
    assert sched.pool.cells_used() == 0


def test_families_that_fit_together_run_together() -> None:
    sched = make(kv_cells=224, page_size=16, parallel=4, budget=64)
    sched.add(request("a", 20, n=2, max_tokens=40))
    sched.add(request("b", 20, n=2, max_tokens=40))
    plan, outcome = sched.schedule()
    assert [r.request_id for r in sched.running] == ["a", "b"]
    while sched.has_work:
        advance(sched, plan)
        finish_done(sched)
        plan, outcome = sched.schedule()
        assert outcome.failed == []


def test_the_rule_holds_back_only_a_family_beside_families() -> None:
    sched = make(kv_cells=128, page_size=16, parallel=8, budget=64)
    lone = request("lone", 90, max_tokens=30)  # more than the room a family leaves: it may park
    sched.add(request("a", 20, n=2, max_tokens=20))
    sched.add(lone)
    sched.schedule()
    assert [r.request_id for r in sched.running] == ["a", "lone"]
    room = sched.cells.family_room
    assert room(request("b", 20, n=2, max_tokens=20), sched.running, 64) is False
    assert room(request("c", 20, n=2, max_tokens=8), sched.running, 64) is True  # 3 pages
    assert room(request("d", 200, max_tokens=100), sched.running, 64) is True  # n = 1
    sched.release(sched.running[0])
    assert room(request("b", 20, n=2, max_tokens=20), sched.running, 64) is True  # none left


def test_a_finished_choice_gives_its_room_back() -> None:
    # a (3 choices of 40) reaches 10 pages: its prompt's full page and 3 of each choice's own;
    # b (2 choices) needs 7 more: 17 pages > 14 until one of a's choices has ended
    sched = make(kv_cells=224, page_size=16, parallel=8, budget=64)
    a = request("a", 20, n=3, max_tokens=40)
    b = request("b", 20, n=2, max_tokens=40)
    sched.add(a)
    plan, _ = sched.schedule()
    advance(sched, plan)
    assert len(a.sequences) == 3
    room = sched.cells.family_room
    assert room(b, sched.running, 64) is False
    sched.finish_sequence(a.sequences[1], "stop")
    assert room(b, sched.running, 64) is True  # 1 + 2 * 3 + 7 = 14 pages
