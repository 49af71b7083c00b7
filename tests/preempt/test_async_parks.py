"""Asynchronous parks on CPU, through a fake copier whose copies land only after
a given number of polls (the engine polls once per step, before planning).

The fake moves the bytes when a copy lands, not when it is issued, as a real copy on a CUDA stream
may: a parking request whose cells were handed out too early would save someone else's K and V,
and a restoring request scheduled too early would attend over cells not yet written. Either would
change the tokens, which every test here compares with a run without parks.
"""

from __future__ import annotations

import logging

import pytest
import torch

import kvpark
from kvpark import SamplingParams
from kvpark.engine.outputs import NoticeEvent, StreamEvent, TokenEvent
from kvpark.engine.slots import describe_slots
from kvpark.sched.request import Request, RequestState
from support.preempt import PolledTransfers, assert_clean

PROMPT = "Write a long story about a dragon who learns to bake bread."
MOVING = (RequestState.PARKING, RequestState.RESTORING)


def make(monkeypatch: pytest.MonkeyPatch, every: int = 0, **options: object) -> kvpark.LLM:
    torch.set_num_threads(1)
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", str(every))
    monkeypatch.setenv("KVPARK_PREEMPT_FAIL_SAVE", "0")
    monkeypatch.setenv("KVPARK_PREEMPT_PLANNER", "on")
    options.setdefault("device", "cpu")  # the fake wraps the runner's synchronous copies
    options.setdefault("dtype", "float32")
    options.setdefault("kv_cells", 1024)
    options.setdefault("parallel", 4)
    return kvpark.LLM(**options)


def make_async(
    monkeypatch: pytest.MonkeyPatch, polls: int, pinned: bool = True, **options: object
) -> tuple[kvpark.LLM, PolledTransfers]:
    llm = make(monkeypatch, **options)
    preemption = llm.engine.preemption
    assert preemption is not None
    assert not preemption.asynchronous  # CPU: synchronous until the fake goes in
    fake = PolledTransfers(llm.engine.runner, llm.engine.scheduler.pool, polls, pinned)
    preemption.parking.transfers = fake
    return llm, fake


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


def kinds(events: list[StreamEvent]) -> list[str]:
    return [e.kind if isinstance(e, NoticeEvent) else "token" for e in events if not _final(e)]


def _final(e: StreamEvent) -> bool:
    return not isinstance(e, NoticeEvent | TokenEvent)


def plain_run(monkeypatch: pytest.MonkeyPatch, n: int) -> tuple[list[int], list[float]]:
    out = make(monkeypatch, preempt=False).generate(PROMPT, greedy(n))[0]
    assert out.choices[0].logprobs is not None
    return out.token_ids, [lp.logprob for lp in out.choices[0].logprobs]


def slot_of(llm: kvpark.LLM, request_id: str) -> dict[str, object]:
    return next(s for s in describe_slots(llm.engine) if s["request_id"] == request_id)


def test_a_park_and_its_resume_hold_their_cells_until_the_copies_land(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens, logprobs = plain_run(monkeypatch, 14)
    llm, fake = make_async(monkeypatch, polls=3, every=6)
    engine = llm.engine
    req = engine.add_request("a", llm.tokenizer.encode(PROMPT), greedy(14))
    states: list[RequestState] = []
    steps: list[list[str]] = []
    got: list[TokenEvent] = []
    while engine.has_work:
        used_before = engine.scheduler.pool.cells_used()
        events = engine.step().get("a", [])
        got += [e for e in events if isinstance(e, TokenEvent)]
        states.append(req.state)
        steps.append(kinds(events))
        if req.state in MOVING:
            seq = req.sequences[0]
            # the cells stay held (a parking request's are not freed, a restoring one's are filled
            # by its copy), and the request took no part in the step
            assert engine.scheduler.pool.seq_len(seq.seq_id) == seq.num_computed > 0
            assert "token" not in steps[-1]
            slot = slot_of(llm, "a")
            assert slot["state"] == req.state.value and slot["is_transferring"] is True
            assert slot["is_preempted"] is False and slot["n_cells"] == seq.num_computed
            assert engine.stats.requests_preempted == 1
        if req.state is RequestState.PARKING and steps[-1] != ["preempted"]:
            assert engine.scheduler.pool.cells_used() == used_before  # nothing freed yet
    first = states.index(RequestState.PARKING)
    assert steps[first] == ["preempted"]  # the notice goes out when the copy out starts
    assert states[first : first + 7] == [RequestState.PARKING] * 3 + [
        RequestState.RESTORING
    ] * 3 + [RequestState.RUNNING]
    assert steps[first + 1 : first + 6] == [[]] * 5  # nothing while in flight
    assert steps[first + 6] == ["resumed", "token"]  # resumed when the copy back has landed
    assert states.count(RequestState.PARKING) == 6  # parked at 6 and 12 tokens, 3 polls each
    assert fake.count("save") == fake.count("restore") == 2 and not fake.in_flight()
    assert [t for e in got for t in e.token_ids] == tokens
    assert [lp.logprob for e in got for lp in e.logprobs or []] == logprobs  # a byte copy
    assert engine.stats.preemptions_total["swap"] == engine.stats.resumes_total == 2
    assert_clean(llm)


@pytest.mark.parametrize("during", MOVING, ids=lambda s: s.value)
@pytest.mark.parametrize("how", ["abort", "close"])
def test_cancel_or_shutdown_during_a_copy_waits_for_it_and_frees_everything(
    monkeypatch: pytest.MonkeyPatch, during: RequestState, how: str
) -> None:
    llm, fake = make_async(monkeypatch, polls=4, every=4)
    engine = llm.engine
    req = engine.add_request("victim", llm.tokenizer.encode(PROMPT), greedy(64))
    for _ in range(40):
        engine.step()
        if req.state is during:
            break
    assert req.state is during
    [copy] = fake.in_flight()
    landed_before = len(fake.used_at_landing)
    if how == "abort":
        assert engine.abort("victim")
    else:
        engine.close()
    assert copy.landed  # waited for, not abandoned
    assert fake.used_at_landing[landed_before] > 0  # and it landed before the cells were freed
    assert engine.stats.preempt_ram_bytes == 0
    assert_clean(llm)


def test_async_parks_under_pressure_let_the_others_decode_during_the_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 256 cells; each request needs ~14 + 160 cells: alone it fits, together they do not
    llm, fake = make_async(monkeypatch, polls=2, kv_cells=256, max_batch_tokens=64)
    engine = llm.engine
    prompts = [PROMPT, "Count from one to a hundred."]
    reqs: list[Request] = [
        engine.add_request(f"r{i}", llm.tokenizer.encode(p), greedy(160))
        for i, p in enumerate(prompts)
    ]
    notices: dict[str, list[str]] = {r.request_id: [] for r in reqs}
    beside = 0
    while engine.has_work:
        events = engine.step()
        for rid, evs in events.items():
            notices[rid] += [k for k in kinds(evs) if k != "token"]
        moving = {r.request_id for r in reqs if r.state in MOVING}
        decoded = {rid for rid, evs in events.items() if "token" in kinds(evs)}
        beside += bool(moving and decoded - moving)
        engine.scheduler.pool.check_integrity()
    assert [r.sequences[0].num_output for r in reqs] == [160, 160]
    assert fake.count("save") >= 1 and fake.count("restore") >= 1
    assert beside > 0  # a request decoded while another one's copy was in flight
    for rid, seen in notices.items():  # strictly paired: preempted, resumed, preempted, ...
        assert seen == ["preempted", "resumed"] * (len(seen) // 2), rid
    assert_clean(llm)


def test_a_pageable_buffer_parks_synchronously_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tokens, _ = plain_run(monkeypatch, 16)
    llm, fake = make_async(monkeypatch, polls=3, pinned=False, every=6)
    preemption = llm.engine.preemption
    assert preemption is not None and preemption.asynchronous  # until a buffer is pageable
    with caplog.at_level(logging.WARNING, logger="kvpark.preempt.buffers"):
        out = llm.generate(PROMPT, greedy(16))[0]
    assert "pageable, so slot 0 parks synchronously from now on" in caplog.text
    assert not preemption.asynchronous  # /props.preempt.async
    assert fake.copies == []  # every copy went through the runner, at once
    assert out.finished is not None and out.finished.parks == 2
    assert out.token_ids == tokens
    assert_clean(llm)
