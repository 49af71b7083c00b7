"""Preemption acceptance tests on a real ``kvpark serve``, forced parks (docs/server.md's streams
and /slots, docs/preemption.md).

Re-creates, in kvpark's own terms, the scenarios of the C++ original's ``test_preempt.py`` and
``test_preempt_notify.py`` where parks come on schedule,
plus the refusals and the run without preemption; test_preempt_pressure.py has the pool that
really fills. Three servers, each started once for the module:

- ``reference``: ``--no-preempt``, 512 cells, 2 slots, 128-token steps. The unparked output that
  parked runs must match, and the llama.cpp-style overflow.
- ``swap_every``: ``KVPARK_PREEMPT_EVERY=8``, 1024 cells, 2 slots: forced swap parks.
- ``recompute_every``: ``KVPARK_PREEMPT_EVERY=8`` and ``KVPARK_PREEMPT_FAIL_SAVE=1``, 256 cells,
  2 slots, 64-token steps: every park (forced or for pressure) is a recompute.

The streams, checks and layout in pages are support/preempt_server.py's; every scenario ends with
its ``settle``.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.preempt_server import (
    EVERY,
    GENERATED,
    PAGE,
    POOL,
    PROMPT_TOKENS,
    RECOMPUTED_TOKENS,
    RECOMPUTES,
    RESUMES,
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
from support.servers import SLOT_FIELDS, Server, serve_for_module

PROMPT = "Once upon a time, in a small village at the edge of the forest,"
CHAT = [{"role": "user", "content": "Name three colours and say why you like them."}]
VOCAB = 49152  # SmolLM2's vocabulary: 49152 is the first invalid token id


# --------------------------------------------------------------------------------- servers


# float32 cells on this module's servers: a recompute replay takes the prompt path, and in normal
# mode its logprobs are compared within float32 rounding; a bf16 pool rounds each path's K and V
# (the default pool's parks are covered by test_preempt_pressure.py and the engine tests)
F32_CELLS = ("--kv-dtype", "float32")


@pytest.fixture(scope="module")
def reference() -> Iterator[Server]:
    """Preemption off: unparked output to compare with, and the llama.cpp-style overflow."""
    yield from serve_for_module(*flags(POOL, 2, 128, "--no-preempt"), *F32_CELLS)


@pytest.fixture(scope="module")
def swap_every() -> Iterator[Server]:
    """Every generating request is parked (swapped: the budget holds it) every 8 tokens."""
    knobs = {"KVPARK_PREEMPT_EVERY": str(EVERY)}
    yield from serve_for_module(*flags(1024, 2, 512), *F32_CELLS, environ=knobs)


@pytest.fixture(scope="module")
def recompute_every() -> Iterator[Server]:
    """Every swap's host allocation fails, so every park (forced or for pressure) recomputes.
    A 16-page pool with 64-token steps, and plain pings off (30 s)."""
    knobs = {"KVPARK_PREEMPT_EVERY": str(EVERY), "KVPARK_PREEMPT_FAIL_SAVE": "1"}
    yield from serve_for_module(*flags(256, 2, 64), *F32_CELLS, environ=knobs)


# ================================================================================= forced parks


def reference_completion(reference: Server, body: dict[str, Any], path: str) -> dict[str, Any]:
    response = post(reference, path, body)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    assert "preempt" not in out  # preemption off: upstream's shape
    return out


def streamed_completion_logprobs(s: Stream) -> list[tuple[str, float]]:
    pairs = []
    for chunk in s.data:
        for choice in chunk.get("choices", []):
            lp = choice.get("logprobs")
            if lp:
                pairs += list(zip(lp["tokens"], lp["token_logprobs"], strict=True))
    return pairs


def streamed_chat_logprobs(s: Stream) -> list[tuple[str, float]]:
    pairs = []
    for chunk in s.data:
        for choice in chunk.get("choices", []):
            lp = choice.get("logprobs")
            if lp:
                pairs += [(e["token"], e["logprob"]) for e in lp["content"]]
    return pairs


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_forced_swap_parks_change_nothing_and_are_announced_in_pairs(
    swap_every: Server, reference: Server, route: str
) -> None:
    if route == "completions":
        path, n = "/v1/completions", 48
        body: dict[str, Any] = {"prompt": PROMPT, "logprobs": 1}
    else:
        path, n = "/v1/chat/completions", 24
        body = {"messages": CHAT, "logprobs": True}
    body |= {"max_tokens": n, "temperature": 0, "ignore_eos": True}
    plain = reference_completion(reference, body, path)
    before = swap_every.metrics()
    s = stream(swap_every, body, path).wait()
    s.assert_ok()

    k = paired(s.notices)
    assert k >= n // EVERY - 1  # a park every 8 tokens, none after the last
    assert s.final["preempt"] == {"parks": k, "recomputes": 0}
    if route == "completions":
        assert s.text() == plain["choices"][0]["text"]
        want = plain["choices"][0]["logprobs"]
        assert streamed_completion_logprobs(s) == list(
            zip(want["tokens"], want["token_logprobs"], strict=True)
        )  # a swap is a byte copy: the logprobs are bit-identical
    else:
        assert s.text() == plain["choices"][0]["message"]["content"]
        want_chat = [(e["token"], e["logprob"]) for e in plain["choices"][0]["logprobs"]["content"]]
        assert streamed_chat_logprobs(s) == want_chat
    assert s.final["usage"] == plain["usage"]
    assert s.final["timings"]["predicted_n"] == n

    # a swap is not reported as a recompute
    assert ": recomputed" not in s.notices
    after = settle(swap_every, before)
    assert delta(after, before, SWAPS) == k
    assert delta(after, before, RECOMPUTES) == 0
    assert delta(after, before, RECOMPUTED_TOKENS) == 0
    assert delta(after, before, RESUMES) == k


def test_a_failed_host_allocation_parks_by_recompute_and_is_reported(
    recompute_every: Server, reference: Server
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    plain = reference_completion(reference, {**body, "logprobs": 1}, "/v1/completions")
    n_prompt = plain["usage"]["prompt_tokens"]
    before = recompute_every.metrics()
    with Watcher(recompute_every) as watcher:
        s = stream(recompute_every, {**body, "logprobs": 1}).wait()
    s.assert_ok()

    # every swap's host allocation fails, so every park is a recompute, and says so
    k = paired(s.notices, recompute=True)
    assert k >= 48 // EVERY - 1
    assert s.final["preempt"] == {"parks": k, "recomputes": k}
    # the replay keeps the tokens (recompute re-runs the prompt as a batch: last bits may move)
    assert s.text() == plain["choices"][0]["text"]
    got = streamed_completion_logprobs(s)
    want = plain["choices"][0]["logprobs"]
    assert [t for t, _ in got] == want["tokens"]
    assert max(abs(a - b) for (_, a), b in zip(got, want["token_logprobs"], strict=True)) < 1e-3
    # ... and is not billed as prompt
    assert s.final["usage"]["prompt_tokens"] == n_prompt
    assert s.final["timings"]["prompt_n"] == n_prompt

    after = settle(recompute_every, before)
    assert delta(after, before, RECOMPUTES) == k
    assert delta(after, before, SWAPS) == 0
    assert delta(after, before, PROMPT_TOKENS) == n_prompt
    assert delta(after, before, GENERATED) == 48
    # each replay re-runs at least the prompt
    assert delta(after, before, RECOMPUTED_TOKENS) >= k * n_prompt
    assert "could not take the host memory" in recompute_every.log()

    watcher.check_invariants()
    seen = [s for _, snap in watcher.slots for s in snap if s["n_recompute"] > 0]
    assert seen, "no /slots snapshot showed a recompute"
    assert max(s["n_recompute"] for s in seen) <= k


def test_a_recompute_park_in_the_prefill_restarts_it_and_counts_the_prompt_once(
    recompute_every: Server,
) -> None:
    """A resident of 128 + 7 tokens (9 pages; never parked on schedule: fewer than 8 tokens) and,
    sent during its prefill, a 200-token prompt whose first 63-row chunk fits the 16-page pool and
    whose second does not:
    it is parked, by recompute, in its prefill and before its first token. Its replay restarts
    the prompt, which is billed once."""
    server = recompute_every
    before = server.metrics()
    resident = stream(server, {"prompt": ids(128), "max_tokens": 7, "ignore_eos": True})
    # the late prompt is sent once the resident holds cells (its prefill has begun), not after
    # its first token: at ~30 ms a step its 7 tokens could be over before the late prompt's
    # second chunk, and then nothing would press
    wait_until(
        "the resident holds cells",
        lambda: server.metrics()["kvpark_kv_cells_used"] > 0 or resident.done.is_set(),
    )
    late = stream(server, {"prompt": ids(200, 5000), "max_tokens": 4, "ignore_eos": True})
    resident.wait().assert_ok()
    late.wait().assert_ok()

    # pings are off (30 s): the stream's first bytes are the notice, well before its first token
    assert late.lines[0][1] == ": preempted", late.lines[:3]
    assert late.first_data_at - late.lines[0][0] >= 0.05
    k = paired(late.notices, recompute=True)
    assert late.final["preempt"] == {"parks": k, "recomputes": k}
    dropped = park_cells(server.log(), late.data[0]["id"])
    assert len(dropped) == k and 0 < dropped[0] < 200, dropped  # parked part way through
    assert late.final["usage"]["prompt_tokens"] == 200
    assert late.final["timings"]["prompt_n"] == 200
    assert late.final["usage"]["completion_tokens"] == 4
    assert resident.final["usage"] == {
        "prompt_tokens": 128,
        "completion_tokens": 7,
        "total_tokens": 135,
        "prompt_tokens_details": {"cached_tokens": 0},  # the cache is off on these servers
    }
    after = settle(server, before)
    assert delta(after, before, PROMPT_TOKENS) == 128 + 200
    assert delta(after, before, SWAPS) == 0
    assert delta(after, before, RECOMPUTES) == k + resident.final["preempt"]["parks"]
    assert delta(after, before, RECOMPUTED_TOKENS) >= sum(dropped)


def test_every_notice_of_a_multi_prompt_stream_names_its_prompt(recompute_every: Server) -> None:
    before = recompute_every.metrics()
    body = {"prompt": ["Red", "Blue"], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    s = stream(recompute_every, body).wait()
    s.assert_ok()

    notices = s.notices
    assert notices and all(
        re.fullmatch(r": (preempted|resumed|recomputed) [01]", n) for n in notices
    ), notices
    parks = 0
    for prompt in "01":
        mine = [n.rsplit(" ", 1)[0] for n in notices if n.endswith(" " + prompt)]
        parks += paired(mine, recompute=True)
        assert mine, f"prompt {prompt} was never parked"
    # a recompute marker comes right after the resume it belongs to, even in a merged stream
    for i, notice in enumerate(notices):
        if notice.startswith(": recomputed"):
            assert notices[i - 1] == ": resumed" + notice[len(": recomputed") :], notices
    assert s.final["preempt"] == {"parks": parks, "recomputes": parks}
    assert s.finish_reasons() == {0: "length", 1: "length"}
    after = settle(recompute_every, before)
    assert delta(after, before, RECOMPUTES) == parks


def test_a_non_streamed_multi_prompt_response_merges_the_preempt_records(
    swap_every: Server,
) -> None:
    before = swap_every.metrics()
    body = {"prompt": ["Red", "Blue", "Green"], "max_tokens": 2 * EVERY, "ignore_eos": True}
    response = post(swap_every, "/v1/completions", {**body, "temperature": 0})
    assert response.status_code == 200, response.text
    out = response.json()
    assert [c["finish_reason"] for c in out["choices"]] == ["length"] * 3
    # each prompt is parked once (after 8 of its 16 tokens): the records add up
    after = settle(swap_every, before)
    assert out["preempt"] == {"parks": parks_of(after) - parks_of(before), "recomputes": 0}
    assert out["preempt"]["parks"] >= 3
    assert out["usage"]["completion_tokens"] == 3 * 2 * EVERY


def test_props_and_idle_slots_describe_the_preemption_settings(
    swap_every: Server, reference: Server
) -> None:
    props = get(swap_every, "/props")
    assert props["preempt"] == {
        "enabled": True,
        "ram_mib": 2048,
        "policy": "fcfs",
        "async": False,  # no asynchronous copies on CPU
        "notices": True,
        "granularity": PAGE,
    }
    assert props["pool"] == {"kv_cells": 1024, "page_size": PAGE, "parallel": 2}
    assert get(reference, "/props")["preempt"]["enabled"] is False
    for slot in get(swap_every, "/slots"):
        assert set(slot) >= SLOT_FIELDS
        assert slot["state"] == "idle"
        assert (slot["is_preempted"], slot["is_transferring"]) == (False, False)
        assert (slot["n_preempt"], slot["n_recompute"], slot["n_cells"]) == (0, 0, 0)


# ================================================================================= refusals


def test_a_bad_or_oversized_prompt_is_refused_before_anything_streams_or_parks(
    swap_every: Server,
) -> None:
    before = swap_every.metrics()
    refused = {
        # a sibling with a token id past the vocabulary
        "invalid sibling": {"prompt": [ids(40), ids(40), [VOCAB]], "max_tokens": 16},
        # a sibling that can never fit the pool (1024 cells)
        "oversized sibling": {"prompt": [ids(16), ids(1100)], "max_tokens": 16},
        # a single request that would outgrow the pool by itself
        "outgrows the pool": {"prompt": ids(1000), "max_tokens": 100},
    }
    for name, body in refused.items():
        s = stream(swap_every, {**body, "ignore_eos": True}).wait()
        assert s.status == 400, (name, s.status)
        assert s.content_type.startswith("application/json"), (name, s.content_type)
        assert not s.lines  # nothing streamed, not even a notice
        error = json.loads(s.error_body)["error"]
        assert error["code"] == 400, error
        if name == "invalid sibling":
            assert "invalid tokens" in error["message"], error
        else:
            assert error["type"] == "exceed_context_size_error", error
    m = swap_every.metrics()
    for name in (SWAPS, RECOMPUTES, PROMPT_TOKENS, GENERATED):
        assert delta(m, before, name) == 0, name  # nothing ran, nothing parked
    # the server lives; a request that was never parked says so
    after = post(swap_every, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    assert after.json()["preempt"] == {"parks": 0, "recomputes": 0}
    settle(swap_every, before)


# ================================================================================= no preemption


def test_without_preemption_an_overflow_gets_the_context_error_and_the_server_lives(
    reference: Server,
) -> None:
    # two requests of 200 + 60 tokens: 17 pages each, 34 together in a 32-page pool
    before = reference.metrics()
    results: dict[int, httpx.Response] = {}

    def run(i: int) -> None:
        body = {"prompt": ids(200, 1000 + 500 * i), "max_tokens": 60, "ignore_eos": True}
        results[i] = post(reference, "/v1/completions", {**body, "temperature": 0})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SCENARIO_TIMEOUT_S)
    assert sorted(r.status_code for r in results.values()) == [200, 500]
    for r in results.values():
        if r.status_code == 500:
            assert "Context size has been exceeded" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 60
            assert "preempt" not in r.json()  # no preempt record when preemption is off
    after = post(reference, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
    m = settle(reference, before)
    assert parks_of(m) == 0
