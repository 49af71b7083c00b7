"""Scheduler alone (no model): admission, chunking, slots, cells, forks. Sampling is simulated."""

from __future__ import annotations

from support.sched_steps import advance, make, request


def test_prompt_is_chunked_within_the_row_budget() -> None:
    sched = make(budget=32)
    sched.add(request("a", 100))
    sizes, samples = [], []
    for _ in range(4):
        plan, _ = sched.schedule()
        sizes.append(plan.n_rows)
        samples.append([i.sample for i in plan.items])
        advance(sched, plan)
    assert sizes == [32, 32, 32, 4]
    assert samples == [[False], [False], [False], [True]]
    sched.pool.check_integrity()


def test_decodes_come_before_prompt_chunks_and_budget_holds() -> None:
    sched = make(budget=16)
    sched.add(request("a", 4))
    plan, _ = sched.schedule()
    advance(sched, plan)
    sched.add(request("b", 40))
    plan, _ = sched.schedule()
    assert [len(i.token_ids) for i in plan.items] == [1, 15]
    assert plan.items[0].sample and not plan.items[1].sample
    assert plan.n_rows <= 16


def test_slot_mapping_follows_page_tables() -> None:
    sched = make(page_size=16)
    sched.add(request("a", 20))
    plan, _ = sched.schedule()
    table = plan.page_tables[0]
    assert len(table) == 2
    expected = [table[p // 16] * 16 + p % 16 for p in range(20)]
    assert plan.slot_mapping == expected
    assert sched.pool.cells_used() == 32  # a partly used page counts in full


def test_slots_limit_admission_in_order() -> None:
    sched = make(parallel=2, budget=64)
    for rid in "abc":
        sched.add(request(rid, 5))
    plan, _ = sched.schedule()
    assert len(plan.items) == 2
    assert [r.request_id for r in sched.waiting] == ["c"]
    sched.release(sched.running[0])
    plan, _ = sched.schedule()
    assert "c" in [r.request_id for r in sched.running]


def test_head_of_line_is_not_overtaken() -> None:
    sched = make(kv_cells=64, budget=64)
    sched.add(request("a", 40))
    plan, _ = sched.schedule()
    advance(sched, plan)
    sched.add(request("big", 30))  # needs 2 pages + headroom: does not fit yet
    sched.add(request("small", 2))
    plan, _ = sched.schedule()
    assert [r.request_id for r in sched.waiting] == ["big", "small"]


def test_a_prompt_that_never_fits_fails_alone() -> None:
    sched = make(kv_cells=32, budget=64)
    sched.add(request("huge", 60))
    plan, outcome = sched.schedule()
    assert plan.empty
    assert [r.request_id for r in outcome.failed] == ["huge"]
    assert sched.pool.cells_used() == 0


def test_fork_shares_prompt_pages_and_copies_the_partial_page() -> None:
    sched = make(page_size=16, parallel=4)
    sched.add(request("a", 20, n=3))
    plan, _ = sched.schedule()
    advance(sched, plan)
    req = sched.running[0]
    assert len(req.sequences) == 3
    full_page = sched.pool.page_table(req.sequences[0].seq_id)[0]
    assert sched.pool.page_refcount(full_page) == 3
    plan, _ = sched.schedule()
    assert len(plan.page_copies) == 2  # one partial page per child
    assert [len(i.token_ids) for i in plan.items] == [1, 1, 1]
    sched.pool.check_integrity()
    sched.release(req)
    assert sched.pool.cells_used() == 0
    assert sched.free_slot_count == 4


def test_n_reserves_its_slots_before_the_fork() -> None:
    sched = make(parallel=3, budget=64)
    sched.add(request("a", 5, n=2))
    sched.add(request("b", 5, n=2))
    sched.schedule()
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_abort_releases_everything() -> None:
    sched = make()
    sched.add(request("a", 50))
    sched.add(request("b", 10))
    sched.schedule()
    assert sched.abort("a") is not None
    assert sched.abort("missing") is None
    sched.abort("b")
    assert sched.pool.cells_used() == 0
    assert not sched.has_work
    sched.pool.check_integrity()


def test_admission_counts_the_fork_copies_of_a_whole_prompt() -> None:
    # prompt 20 of n=3 on 16-cell pages: 2 pages, then a copy of the partial page per child
    alone = make(kv_cells=48, budget=64)
    alone.add(request("a", 20, n=3))
    plan, outcome = alone.schedule()
    assert plan.empty and [r.request_id for r in outcome.failed] == ["a"]
    beside = make(kv_cells=96, budget=64)
    beside.add(request("a", 30))
    plan, _ = beside.schedule()
    advance(beside, plan)
    beside.add(request("b", 20, n=3))  # 4 pages and a page of headroom for a: 80 > 64 free
    beside.schedule()
    assert [r.request_id for r in beside.waiting] == ["b"]


def test_a_later_admission_leaves_the_cells_an_earlier_fork_copies_into() -> None:
    # 5 pages of 16: a (n=3, 20 rows) takes 2 pages and is promised 2 copies; b (20 rows, 2
    # pages and a page of headroom for a) would fit the 3 free pages were the copies not counted
    sched = make(kv_cells=80, page_size=16, budget=64)
    sched.add(request("a", 20, n=3))
    sched.add(request("b", 20))
    plan, outcome = sched.schedule()
    assert outcome.failed == []
    assert [r.request_id for r in sched.running] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b"]
    advance(sched, plan)  # the fork: a PoolFullError here is a request failed for nothing
    assert len(sched.running[0].sequences) == 3
    sched.pool.check_integrity()


def test_a_later_chunk_leaves_the_cells_an_earlier_fork_copies_into() -> None:
    # 8 pages of 16; a (n=3) and b both hold 2 pages mid-prompt. a's last 8 rows take a third
    # page and its fork 2 copies of it; b's chunk after it in the same step may take only the
    # one page left beside those copies, not the 2 its 32 rows want
    sched = make(kv_cells=128, page_size=16, budget=32)
    sched.add(request("a", 40, n=3))
    sched.add(request("b", 64))
    plan, _ = sched.schedule()  # a's first 32 rows
    advance(sched, plan)
    a = sched.running[0]
    plan, _ = sched.schedule(rows={a.sequences[0].seq_id: 0})  # b's first 32
    advance(sched, plan)
    b = sched.running[1]
    plan, _ = sched.schedule(rows={a.sequences[0].seq_id: 8, b.sequences[0].seq_id: 32})
    assert [len(i.token_ids) for i in plan.items] == [8, 16]
    advance(sched, plan)  # a forks into the 2 pages its copies were promised
    assert len(a.sequences) == 3 and b.sequences[0].num_computed == 48
    assert sched.pool.cells_free() == 0
    sched.pool.check_integrity()


def test_the_last_chunk_of_an_n_prompt_reports_the_fork_pages_it_lacks() -> None:
    sched = make(kv_cells=96, budget=32)
    sched.add(request("a", 30))
    plan, _ = sched.schedule()
    advance(sched, plan)
    sched.add(request("b", 40, n=3))
    plan, _ = sched.schedule()
    assert [len(i.token_ids) for i in plan.items] == [1, 31]
    advance(sched, plan)
    # b's last 9 rows take a third page and each child a copy of it: 48 cells, 32 free
    plan, outcome = sched.schedule(report_shortfall=True)
    assert plan.empty and outcome.shortfall == 16
    sched.pool.check_integrity()


def test_a_family_short_of_a_cell_sits_the_step_out_while_others_run() -> None:
    # 4 pages of 16: a (lone) and b (n=2) each hold a 16-row prompt page; the next decodes want
    # 3 new pages and 2 are free: a takes one, b's first choice the other, its second none
    sched = make(kv_cells=64, page_size=16, budget=64)
    sched.add(request("a", 16, max_tokens=32))
    sched.add(request("b", 16, n=2, max_tokens=32))
    plan, _ = sched.schedule()
    advance(sched, plan)
    a, b = sched.running
    plan, outcome = sched.schedule()
    assert outcome.failed == []
    assert [i.seq_id for i in plan.items] == [a.sequences[0].seq_id]  # no row of b's
    assert len(plan.slot_mapping) == 1
    sched.pool.check_integrity()
    advance(sched, plan)
    sched.release(a)  # a finishes: its pages come back and b's choices both draw
    plan, outcome = sched.schedule()
    assert outcome.failed == []
    assert sorted(i.seq_id for i in plan.items) == sorted(s.seq_id for s in b.sequences)
    sched.pool.check_integrity()


def test_when_nothing_can_run_the_newest_stalled_request_fails() -> None:
    # two pages: b's shared prompt page and one more, but its two choices each want a page
    sched = make(kv_cells=32, page_size=16, budget=64)
    sched.add(request("b", 16, n=2, max_tokens=32))
    plan, _ = sched.schedule()
    advance(sched, plan)
    plan, outcome = sched.schedule()
    assert plan.empty
    assert [r.request_id for r in outcome.failed] == ["b"]
    assert sched.pool.cells_used() == 0
    assert not sched.has_work
    sched.pool.check_integrity()
