"""Streams, watchers and checks for the preemption scenarios on a real ``kvpark serve``
(tests/server/test_preempt_forced.py, test_preempt_recompute.py, test_preempt_pressure.py and
test_preempt_late_prompt.py; docs/server.md and docs/preemption.md).

Prompts are token-id lists, so every length, and so every page count, is exact. Pages are 16 cells;
the planner parks when ``used + step + 1 page of margin > pool``, so the scenarios are laid out in
pages (a ``pressure`` pool is 32 of them).

Every scenario ends with :func:`settle`: once idle nothing is running, parked, held in host RAM or
in the pool, every slot is idle, and every park of the scenario was resumed (less the ones a client
cancelled while parked).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from support.servers import SLOT_FIELDS, Server
from support.sse import sse_data

PAGE = 16
POOL = 512  # cells of the `pressure` and `reference` servers
EVERY = 8  # KVPARK_PREEMPT_EVERY of the forced-park servers
SCENARIO_TIMEOUT_S = 400.0  # any one stream; generous: the cores are shared with other suites
SETTLE_TIMEOUT_S = 30.0
POLL_S = 0.1
SAME_STEP_S = 0.03  # notices of one step reach the client within this of each other
WATCH_S = 0.25  # /slots polling while a scenario runs (the engine shares the GIL with HTTP)

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


def flags(kv_cells: int, parallel: int, max_batch_tokens: int, *more: str) -> tuple[str, ...]:
    """The scenarios' servers. Their prompts (``ids``) share prefixes and their layouts are in
    cells held, so the prefix cache is off here: a hit would change who fits where. The cache
    with parks has its own tests (tests/engine/test_prefix_cache_engine.py,
    tests/server/test_prefix_cache_server.py)."""
    pool = ("--kv-cells", str(kv_cells), "--page-size", str(PAGE), "--parallel", str(parallel))
    return (*pool, "--max-batch-tokens", str(max_batch_tokens), "--no-prefix-cache", *more)


# --------------------------------------------------------------------------------- HTTP helpers


def get(server: Server, path: str) -> Any:
    response = httpx.get(server.base_url + path, headers=server.headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        server.base_url + path, json=body, headers=server.headers, timeout=SCENARIO_TIMEOUT_S
    )


def parks_of(m: dict[str, float]) -> float:
    return m[SWAPS] + m[RECOMPUTES]


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after[name] - before[name]


def wait_until(
    what: str,
    check: Callable[[], bool],
    timeout: float = SCENARIO_TIMEOUT_S,
    poll_s: float = POLL_S,
) -> None:
    """``poll_s``: shorter where the moment matters (a step of the default model is ~10 ms)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"precondition not met after {timeout:.0f} s: {what}")
        time.sleep(poll_s)


def settle(server: Server, before: dict[str, float], unresumed: int = 0) -> dict[str, float]:
    """Wait (bounded) until the server is idle, then check that nothing is left behind.

    Idle: every slot free and nothing running, waiting or in the pool. The engine refreshes its
    gauges before it publishes /slots, so the other gauges must read 0 by then too."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        slots = get(server, "/slots")
        m = server.metrics()
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
        return sse_data(line for _, line in self.lines)

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
                self.gauges.append(self.server.metrics())
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
