"""Preemption acceptance tests on a real ``kvpark serve`` (SPEC §3.3, §3.4, §5).

Re-creates, in kvpark's own terms, the scenarios of the C++ original's ``test_preempt.py`` and
``test_preempt_notify.py`` (reference/original-system.md §5.1, §5.2). Five servers, each started
once for the module:

- ``reference``: ``--no-preempt``, 512 cells, 2 slots, 128-token steps. The unparked output that
  parked runs must match, and the llama.cpp-style overflow.
- ``swap_every``: ``KVPARK_PREEMPT_EVERY=8``, 1024 cells, 2 slots: forced swap parks.
- ``recompute_every``: ``KVPARK_PREEMPT_EVERY=8`` and ``KVPARK_PREEMPT_FAIL_SAVE=1``, 256 cells,
  2 slots, 64-token steps: every park (forced or for pressure) is a recompute.
- ``pressure`` (parametrized ``fcfs`` / ``cost``): 512 cells, 3 slots, 128-token steps,
  ``--sse-ping-interval 1``: a pool that really fills; parks come from the planner only.

Prompts are token-id lists, so every length, and so every page count, is exact. Pages are 16 cells;
the planner parks when ``used + step + 1 page of margin > pool``, so the scenarios below are laid
out in pages (a ``pressure`` pool is 32 of them).

Every scenario ends with :func:`settle`: once idle nothing is running, parked, held in host RAM or
in the pool, every slot is idle, and every park of the scenario was resumed (less the ones a client
cancelled while parked).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from server_fixtures import SLOT_FIELDS, Server, serve_for_module

PAGE = 16
POOL = 512  # cells of the `pressure` and `reference` servers
EVERY = 8  # KVPARK_PREEMPT_EVERY of the forced-park servers
VOCAB = 49152  # SmolLM2's vocabulary: 49152 is the first invalid token id
SCENARIO_TIMEOUT_S = 400.0  # any one stream; generous: the cores are shared with other suites
SETTLE_TIMEOUT_S = 30.0
POLL_S = 0.1
SAME_STEP_S = 0.03  # notices of one step reach the client within this of each other
WATCH_S = 0.25  # /slots polling while a scenario runs (the engine shares the GIL with HTTP)

PROMPT = "Once upon a time, in a small village at the edge of the forest,"
CHAT = [{"role": "user", "content": "Name three colours and say why you like them."}]

GAUGES = (
    "kvpark_requests_running",
    "kvpark_requests_waiting",
    "kvpark_requests_preempted",
    "kvpark_kv_cells_used",
    "kvpark_preempt_ram_bytes",
)
SWAPS = 'kvpark_preemptions_total{mode="swap"}'
RECOMPUTES = 'kvpark_preemptions_total{mode="recompute"}'
RESUMES = "kvpark_resumes_total"
ROTATIONS = "kvpark_rotations_total"
PROMPT_TOKENS = "kvpark_prompt_tokens_total"
GENERATED = "kvpark_generation_tokens_total"
RECOMPUTED_TOKENS = "kvpark_recomputed_tokens_total"
NOTICE = re.compile(r": (preempted|resumed|recomputed)( \d+)?")


def ids(n: int, base: int = 1000) -> list[int]:
    """A prompt of exactly ``n`` valid token ids."""
    return [base + (i * 7) % 3000 for i in range(n)]


# --------------------------------------------------------------------------------- servers


def flags(kv_cells: int, parallel: int, max_batch_tokens: int, *more: str) -> tuple[str, ...]:
    pool = ("--kv-cells", str(kv_cells), "--page-size", str(PAGE), "--parallel", str(parallel))
    return (*pool, "--max-batch-tokens", str(max_batch_tokens), *more)


@pytest.fixture(scope="module")
def reference() -> Iterator[Server]:
    """Preemption off: unparked output to compare with, and the llama.cpp-style overflow."""
    yield from serve_for_module(*flags(POOL, 2, 128, "--no-preempt"))


@pytest.fixture(scope="module")
def swap_every() -> Iterator[Server]:
    """Every generating request is parked (swapped: the budget holds it) every 8 tokens."""
    yield from serve_for_module(*flags(1024, 2, 512), environ={"KVPARK_PREEMPT_EVERY": str(EVERY)})


@pytest.fixture(scope="module")
def recompute_every() -> Iterator[Server]:
    """Every swap's host allocation fails, so every park (forced or for pressure) recomputes.
    A 16-page pool with 64-token steps, and plain pings off (30 s)."""
    knobs = {"KVPARK_PREEMPT_EVERY": str(EVERY), "KVPARK_PREEMPT_FAIL_SAVE": "1"}
    yield from serve_for_module(*flags(256, 2, 64), environ=knobs)


@pytest.fixture(scope="module", params=["fcfs", "cost"])
def policy(request: pytest.FixtureRequest) -> str:
    """The ``pressure`` server's --preempt-policy."""
    return str(request.param)


@pytest.fixture(scope="module")
def pressure(policy: str) -> Iterator[Server]:
    """A 32-page pool that really fills; parks come from the planner only."""
    more = ("--preempt-policy", policy, "--sse-ping-interval", "1")
    yield from serve_for_module(*flags(POOL, 3, 128, *more))


# --------------------------------------------------------------------------------- HTTP helpers


def get(server: Server, path: str) -> Any:
    response = httpx.get(server.base_url + path, headers=server.headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        server.base_url + path, json=body, headers=server.headers, timeout=SCENARIO_TIMEOUT_S
    )


def metrics(server: Server) -> dict[str, float]:
    """Every sample of /metrics but the histograms', labelled ones under their full name."""
    text = httpx.get(server.base_url + "/metrics", headers=server.headers, timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvpark_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def parks_of(m: dict[str, float]) -> float:
    return m[SWAPS] + m[RECOMPUTES]


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after[name] - before[name]


def wait_until(what: str, check: Callable[[], bool], timeout: float = SCENARIO_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"precondition not met after {timeout:.0f} s: {what}")
        time.sleep(POLL_S)


def settle(server: Server, before: dict[str, float], unresumed: int = 0) -> dict[str, float]:
    """Wait (bounded) until the server is idle, then check that nothing is left behind.

    Idle: every slot free and nothing running, waiting or in the pool. The engine refreshes its
    gauges before it publishes /slots, so the other gauges must read 0 by then too."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        slots = get(server, "/slots")
        m = metrics(server)
        work = ("kvpark_requests_running", "kvpark_requests_waiting", "kvpark_kv_cells_used")
        idle = all(m[g] == 0 for g in work) and all(s["state"] == "idle" for s in slots)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {g: m[g] for g in GAUGES} == dict.fromkeys(GAUGES, 0.0)
    assert [s["state"] for s in slots] == ["idle"] * len(slots)
    assert not any(s["is_preempted"] or s["is_transferring"] for s in slots)
    # every park of this scenario came back, except those cancelled while parked
    assert delta(m, before, RESUMES) == parks_of(m) - parks_of(before) - unresumed
    return m


# --------------------------------------------------------------------------------- streams


@dataclass
class Stream:
    """One streamed request, read on its own thread; every non-empty line with its arrival."""

    server: Server
    path: str
    body: dict[str, Any]
    status: int = 0
    error_body: bytes = b""
    content_type: str = ""
    lines: list[tuple[float, str]] = field(default_factory=list)
    failure: Exception | None = None
    sent_at: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        self.sent_at = time.monotonic()
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        url = self.server.base_url + self.path
        try:
            with httpx.stream(
                "POST",
                url,
                json={"stream_options": {"include_usage": True}, **self.body, "stream": True},
                headers=self.server.headers,
                timeout=SCENARIO_TIMEOUT_S,
            ) as response:
                self.status = response.status_code
                self.content_type = response.headers.get("content-type", "")
                if response.status_code != 200:
                    self.error_body = response.read()
                    return
                for line in response.iter_lines():
                    if line:
                        self.lines.append((time.monotonic(), line))
                    if self.stop.is_set():
                        return  # leaving the block closes the connection: the client is gone
        except Exception as exc:  # reported by wait()
            self.failure = exc
        finally:
            self.done.set()

    def wait(self, timeout: float = SCENARIO_TIMEOUT_S) -> Stream:
        assert self.done.wait(timeout), f"the stream did not end within {timeout:.0f} s"
        assert self.failure is None, repr(self.failure)
        return self

    def close(self) -> None:
        """Hang up (at the next line, which a parked stream gets within a keepalive period)."""
        self.stop.set()
        self.wait(30)

    # -- views

    @property
    def comments(self) -> list[tuple[float, str]]:
        return [(t, line) for t, line in self.lines if line.startswith(":")]

    @property
    def timed_notices(self) -> list[tuple[float, str]]:
        return [(t, line) for t, line in self.comments if NOTICE.fullmatch(line)]

    @property
    def notices(self) -> list[str]:
        return [line for _, line in self.timed_notices]

    def first(self, line: str) -> float:
        """Arrival of the first line equal to ``line``."""
        arrivals = [t for t, seen in self.lines if seen == line]
        assert arrivals, f"no {line!r} in the stream: {[seen for _, seen in self.lines][:8]}"
        return arrivals[0]

    @property
    def data(self) -> list[dict[str, Any]]:
        out = []
        for _, line in self.lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[len("data: ") :]))
        return out

    @property
    def first_data_at(self) -> float:
        arrivals = [t for t, line in self.lines if line.startswith("data: ")]
        assert arrivals, "no data in the stream"
        return arrivals[0]

    @property
    def final(self) -> dict[str, Any]:
        """The last chunk (``include_usage`` is on): usage, timings and the preempt record."""
        last = self.data[-1]
        assert "timings" in last and "preempt" in last, last
        return last

    def text(self, index: int = 0) -> str:
        parts = []
        for chunk in self.data:
            for choice in chunk.get("choices", []):
                if choice["index"] == index:
                    parts.append(choice.get("text") or choice.get("delta", {}).get("content", ""))
        return "".join(p for p in parts if p)

    def finish_reasons(self) -> dict[int, str]:
        out = {}
        for chunk in self.data:
            for choice in chunk.get("choices", []):
                if choice.get("finish_reason"):
                    out[choice["index"]] = choice["finish_reason"]
        return out

    def assert_ok(self) -> None:
        assert self.status == 200, self.error_body
        assert self.lines[-1][1] == "data: [DONE]"
        assert not any("error" in chunk for chunk in self.data), self.data


def stream(server: Server, body: dict[str, Any], path: str = "/v1/completions") -> Stream:
    return Stream(server, path, body).start()


def paired(notices: list[str], recompute: bool = False) -> int:
    """Check that notices are strictly paired; return the number of parks."""
    unit = (
        [": preempted", ": resumed", ": recomputed"] if recompute else [": preempted", ": resumed"]
    )
    k = len(notices) // len(unit)
    assert notices == unit * k, notices
    return k


@dataclass
class Watcher:
    """Polls /slots (and now and then /metrics) in the background while a scenario runs."""

    server: Server
    slots: list[tuple[float, list[dict[str, Any]]]] = field(default_factory=list)
    gauges: list[dict[str, float]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def __enter__(self) -> Watcher:
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(30)

    def _poll(self) -> None:
        deadline = time.monotonic() + SCENARIO_TIMEOUT_S
        i = 0
        while not self.stop.is_set() and time.monotonic() < deadline:
            self.slots.append((time.monotonic(), get(self.server, "/slots")))
            if i % 2 == 0:
                self.gauges.append(metrics(self.server))
            i += 1
            time.sleep(WATCH_S)

    def check_invariants(self) -> None:
        assert self.slots, "no /slots snapshot taken"
        for _, snapshot in self.slots:
            for slot in snapshot:
                assert set(slot) >= SLOT_FIELDS, slot
                assert not (slot["is_preempted"] and slot["is_transferring"]), slot
                assert slot["is_transferring"] is False, slot  # no asynchronous copy on CPU
                assert (slot["state"] == "parked") == slot["is_preempted"], slot
                assert slot["n_recompute"] <= slot["n_preempt"], slot
                if slot["is_preempted"]:
                    assert slot["n_cells"] == 0 and slot["n_preempt"] >= 1, slot

    def parked(self) -> list[dict[str, Any]]:
        return [s for _, snap in self.slots for s in snap if s["is_preempted"]]


def park_cells(log: str, request_id: str) -> list[int]:
    """Cells released by each park of ``request_id`` (from the server log)."""
    found = re.findall(
        rf"preempted request {re.escape(request_id)} by (swap|recompute): (\d+) cells", log
    )
    return [int(cells) for _, cells in found]


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
    before = metrics(swap_every)
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
    before = metrics(recompute_every)
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
    before = metrics(server)
    resident = stream(server, {"prompt": ids(128), "max_tokens": 7, "ignore_eos": True})
    # the late prompt is sent once the resident holds cells (its prefill has begun), not after
    # its first token: at ~30 ms a step its 7 tokens could be over before the late prompt's
    # second chunk, and then nothing would press
    wait_until(
        "the resident holds cells",
        lambda: metrics(server)["kvpark_kv_cells_used"] > 0 or resident.done.is_set(),
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
    }
    after = settle(server, before)
    assert delta(after, before, PROMPT_TOKENS) == 128 + 200
    assert delta(after, before, SWAPS) == 0
    assert delta(after, before, RECOMPUTES) == k + resident.final["preempt"]["parks"]
    assert delta(after, before, RECOMPUTED_TOKENS) >= sum(dropped)


def test_every_notice_of_a_multi_prompt_stream_names_its_prompt(recompute_every: Server) -> None:
    before = metrics(recompute_every)
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
    before = metrics(swap_every)
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
    before = metrics(swap_every)
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
    m = metrics(swap_every)
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
    before = metrics(reference)
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


# ================================================================================= pressure


def test_props_report_the_policy(pressure: Server, policy: str) -> None:
    preempt = get(pressure, "/props")["preempt"]
    assert preempt["enabled"] is True and preempt["policy"] == policy
    assert get(pressure, "/props")["pool"] == {"kv_cells": POOL, "page_size": PAGE, "parallel": 3}


def test_two_generations_that_do_not_fit_together_both_finish(pressure: Server) -> None:
    # 200 + 60 tokens each: 17 pages alone, 34 of 32 together
    before = metrics(pressure)
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
    before = metrics(pressure)
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
    assert s.final["usage"] == {"prompt_tokens": 528, "completion_tokens": 72, "total_tokens": 600}
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
def late_run(pressure: Server) -> LateRun:
    """The resident holds 19-20 pages when the late prompt arrives; its first 127-row chunk fits
    (8 pages), its second (5 more) does not: it is parked in its prefill, before its first token,
    by either policy (``cost``: it holds fewer cells than the resident). It waits 2 s, then
    rotates the resident out; short requests keep arriving meanwhile."""
    before = metrics(pressure)
    with Watcher(pressure) as watcher:
        resident = stream(pressure, {"prompt": ids(300), "max_tokens": 150, "ignore_eos": True})
        wait_until(
            "the resident decodes", lambda: len(resident.data) >= 4 or resident.done.is_set()
        )
        late = stream(pressure, {"prompt": ids(200, 5000), "max_tokens": 16, "ignore_eos": True})
        wait_until("the late prompt is parked", lambda: bool(late.notices) or late.done.is_set())
        assert late.notices[:1] == [": preempted"], "precondition not met: nothing was parked"
        shorts: list[tuple[float, float, int]] = []

        def short(sent: float) -> None:
            body = {"prompt": ids(SHORT_PROMPT, 9000), "max_tokens": 2, "ignore_eos": True}
            r = post(pressure, "/v1/completions", body)
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
    after = settle(pressure, before)
    return LateRun(resident, late, shorts, watcher, before, after, pressure.log())


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
    before = metrics(pressure)
    body = {"prompt": ids(300), "n": 2, "max_tokens": 100, "ignore_eos": True}
    resident = stream(pressure, body)
    wait_until("the resident decodes", lambda: len(resident.data) >= 4)
    late = stream(pressure, {"prompt": ids(200, 5000), "max_tokens": 16, "ignore_eos": True})
    wait_until("the late prompt is parked", lambda: parked_slot(pressure, 200))
    held = metrics(pressure)
    assert held["kvpark_preempt_ram_bytes"] > 0 and held["kvpark_requests_preempted"] == 1
    late.close()
    # its slot and its parked bytes come back while the resident goes on
    wait_until(
        "the cancelled request's slot is free",
        lambda: all(s["n_prompt_tokens"] != 200 for s in get(pressure, "/slots")),
        timeout=30,
    )
    m = metrics(pressure)
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
    before = metrics(pressure)
    body = {"prompt": [ids(300), ids(200, 5000)], "max_tokens": 60, "ignore_eos": True}
    s = stream(pressure, body)
    wait_until("a prompt is parked", lambda: any(n.startswith(": preempted") for n in s.notices))
    wait_until("/slots shows it", lambda: any(x["is_preempted"] for x in get(pressure, "/slots")))
    parked = sum(1 for x in get(pressure, "/slots") if x["is_preempted"])
    s.close()
    settle(pressure, before, unresumed=parked)
