"""Preemption acceptance tests on a real ``kvpark serve``, forced swap parks (docs/server.md's
streams and /slots, docs/preemption.md).

Re-creates, in kvpark's own terms, the scenarios of the C++ original's ``test_preempt.py`` and
``test_preempt_notify.py`` where parks come on schedule and are swaps, plus the refusals and the
run without preemption; test_preempt_recompute.py has the parks by recompute,
test_preempt_pressure.py the pool that really fills. Two servers, each started once for the module:

- ``reference``: ``--no-preempt``, 512 cells, 2 slots, 128-token steps. The unparked output that
  parked runs must match, and the llama.cpp-style overflow.
- ``swap_every``: ``KVPARK_PREEMPT_EVERY=8``, 1024 cells, 2 slots: forced swap parks.

The streams, checks and layout in pages are support/preempt_server.py's, the reference
support/preempt_reference.py's; every scenario ends with its ``settle``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.preempt_reference import (
    F32_CELLS,
    PROMPT,
    reference_completion,
    serve_reference,
    streamed_chat_logprobs,
    streamed_completion_logprobs,
)
from support.preempt_server import (
    EVERY,
    GENERATED,
    PAGE,
    PROMPT_TOKENS,
    RECOMPUTED_TOKENS,
    RECOMPUTES,
    RESUMES,
    SCENARIO_TIMEOUT_S,
    SWAPS,
    delta,
    flags,
    get,
    ids,
    paired,
    parks_of,
    post,
    settle,
    stream,
)
from support.servers import SLOT_FIELDS, Server, serve_for_module

CHAT = [{"role": "user", "content": "Name three colours and say why you like them."}]
VOCAB = 49152  # SmolLM2's vocabulary: 49152 is the first invalid token id


# --------------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def reference() -> Iterator[Server]:
    """Preemption off: unparked output to compare with, and the llama.cpp-style overflow."""
    yield from serve_reference()


@pytest.fixture(scope="module")
def swap_every() -> Iterator[Server]:
    """Every generating request is parked (swapped: the budget holds it) every 8 tokens."""
    knobs = {"KVPARK_PREEMPT_EVERY": str(EVERY)}
    yield from serve_for_module(*flags(1024, 2, 512), *F32_CELLS, environ=knobs)


# ================================================================================= forced parks


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
    assert props["pool"] == {
        "kv_cells": 1024,
        "page_size": PAGE,
        "parallel": 2,
        "window_cells": None,
    }
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
