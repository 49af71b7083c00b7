"""Preemption acceptance tests on a real ``kvpark serve``, forced parks by recompute
(docs/server.md's streams and /slots, docs/preemption.md): every swap's host allocation fails, so
every park recomputes, says so in its notices, replays to the same tokens, and is not billed as
prompt; a park in the prefill restarts it; every notice of a multi-prompt stream names its prompt.
test_preempt_forced.py has the swap parks. Two servers, each started once for the module:

- ``recompute_every``: ``KVPARK_PREEMPT_EVERY=8`` and ``KVPARK_PREEMPT_FAIL_SAVE=1``, 256 cells,
  2 slots, 64-token steps: every park (forced or for pressure) is a recompute.
- ``reference``: ``--no-preempt``: the unparked output that parked runs must match.

The streams, checks and layout in pages are support/preempt_server.py's, the reference
support/preempt_reference.py's; every scenario ends with its ``settle``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from support.preempt_reference import (
    F32_CELLS,
    PROMPT,
    reference_completion,
    serve_reference,
    streamed_completion_logprobs,
)
from support.preempt_server import (
    EVERY,
    GENERATED,
    PROMPT_TOKENS,
    RECOMPUTED_TOKENS,
    RECOMPUTES,
    SWAPS,
    Watcher,
    delta,
    flags,
    ids,
    paired,
    park_cells,
    settle,
    stream,
    wait_until,
)
from support.servers import Server, serve_for_module

# --------------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def recompute_every() -> Iterator[Server]:
    """Every swap's host allocation fails, so every park (forced or for pressure) recomputes.
    A 16-page pool with 64-token steps, and plain pings off (30 s)."""
    knobs = {"KVPARK_PREEMPT_EVERY": str(EVERY), "KVPARK_PREEMPT_FAIL_SAVE": "1"}
    yield from serve_for_module(*flags(256, 2, 64), *F32_CELLS, environ=knobs)


@pytest.fixture(scope="module")
def reference() -> Iterator[Server]:
    """Preemption off: unparked output to compare with."""
    yield from serve_reference()


# ================================================================================= recompute parks


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
    # its first token: at ~10-30 ms a step its 7 tokens could be over before the late prompt's
    # second chunk, and then nothing would press; so the gauge is polled every few ms (a 100 ms
    # poll let a loaded machine miss the window: the resident's whole run is ~9 steps)
    wait_until(
        "the resident holds cells",
        lambda: server.metrics()["kvpark_kv_cells_used"] > 0 or resident.done.is_set(),
        poll_s=0.005,
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
