"""``/v1/responses`` streams across forced parks, and a dropped stream (docs/server.md, "Streams").

One server parks every generating request every 8 tokens (``KVPARK_PREEMPT_EVERY``, swap parks).
The park notices must ride the Responses stream as the comments they are on a chat stream, paired
the same way, with the final object's ``preempt`` record counting them; the text must be the
chat route's on the same server. A client that hangs up mid-stream must leave nothing behind.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from support.preempt_server import EVERY, flags, paired, settle
from support.servers import Server, serve_for_module

BODY = {
    "model": "default",
    "input": "Tell me a long story about a lighthouse keeper.",
    "max_output_tokens": 40,
    "temperature": 0.0,
    "stream": True,
}
NOTICE = re.compile(r": (preempted|resumed|recomputed)")


@pytest.fixture(scope="module")
def swap_every() -> Iterator[Server]:
    knobs = {"KVPARK_PREEMPT_EVERY": str(EVERY)}
    yield from serve_for_module(*flags(1024, 2, 512), "--kv-dtype", "float32", environ=knobs)


def stream_lines(server: Server, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", server.base_url + path, json=body, timeout=400) as response:
        assert response.status_code == 200, response.read()
        return [line for line in response.iter_lines() if line]


def events_of(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]


def test_park_notices_ride_the_stream(swap_every: Server) -> None:
    before = swap_every.metrics()
    lines = stream_lines(swap_every, "/v1/responses", BODY)
    notices = [line for line in lines if NOTICE.fullmatch(line)]
    parks = paired(notices)
    assert parks >= 2  # 40 tokens, a park every 8
    # a notice sits between two events, never inside one (an event line is followed by its data)
    for i, line in enumerate(lines):
        if line.startswith("event: "):
            assert lines[i + 1].startswith("data: "), lines[i : i + 2]
    events = events_of(lines)
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    assert final["response"]["preempt"] == {"parks": parks, "recomputes": 0}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["response"]["output_text"]
    chat_body = {
        "model": "default",
        "messages": [{"role": "user", "content": BODY["input"]}],
        "max_tokens": 40,
        "temperature": 0.0,
        "stream": True,
    }
    chat_lines = stream_lines(swap_every, "/v1/chat/completions", chat_body)
    chat_text = "".join(
        choice["delta"].get("content", "")
        for chunk in events_of(chat_lines[:-1])  # the last line is [DONE]
        for choice in chunk["choices"]
    )
    assert text == chat_text
    settle(swap_every, before)


def test_a_dropped_stream_frees_its_cells(swap_every: Server) -> None:
    before = swap_every.metrics()
    body = {**BODY, "max_output_tokens": 400}
    deltas = 0
    with httpx.stream("POST", swap_every.base_url + "/v1/responses", json=body, timeout=400) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and "output_text.delta" in line:
                deltas += 1
            if deltas == 3:
                break  # hang up: leaving the block closes the connection
    assert deltas == 3
    swap_every.wait_cells_free()
    # the abort may land while the request is parked or running: nothing is left either way
    idle = ("kvpark_requests_running", "kvpark_requests_waiting", "kvpark_requests_preempted")
    deadline = time.monotonic() + 30
    while any(swap_every.metric(g) for g in idle) and time.monotonic() < deadline:
        time.sleep(0.2)
    after = swap_every.metrics()
    assert {g: after[g] for g in idle} == dict.fromkeys(idle, 0.0)
    assert after["kvpark_preempt_ram_bytes"] == 0
    generated = after["kvpark_generation_tokens_total"] - before["kvpark_generation_tokens_total"]
    assert generated < 400  # aborted, not run to its end
    # and the server still answers
    started = time.monotonic()
    lines = stream_lines(swap_every, "/v1/responses", {**BODY, "max_output_tokens": 4})
    assert events_of(lines)[-1]["type"] == "response.incomplete"
    assert time.monotonic() - started < 400


def test_the_openai_client_reads_a_parked_stream(swap_every: Server) -> None:
    """The notices are comments: the ``openai`` client's stream skips them, event by event."""
    client = openai.OpenAI(base_url=swap_every.base_url + "/v1", api_key="unused", max_retries=0)
    body = {k: v for k, v in BODY.items() if k != "stream"}
    events = list(client.responses.create(**body, stream=True))  # type: ignore[call-overload]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.status == "incomplete"  # 40 tokens of a long story
    assert final.model_extra is not None and final.model_extra["preempt"]["parks"] >= 2
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == final.output_text
