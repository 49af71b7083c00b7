"""``POST /v1/messages`` over forced parks: the notices ride the Anthropic stream as SSE comments
with the same pairing rules, the ``preempt`` record counts them, the output is what an unparked
run gives, and a client that hangs up while parked gives everything back.

The server parks every generating request every 8 tokens (``KVPARK_PREEMPT_EVERY``, swap parks)
and runs without an API key, so the ``anthropic`` client's key is ignored.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.messages import GREEDY, ask, client, post, raw_stream, text_of
from support.preempt_server import EVERY, RESUMES, flags, paired, parks_of, settle
from support.servers import Server, serve_for_module

STORY = "Tell me a very long story about a dragon."
WEATHER = {
    "name": "get_weather",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TOOL_CALL = ask(
    "What is the weather in Paris?",
    160,
    tools=[WEATHER],
    tool_choice={"type": "tool", "name": "get_weather"},
)


@pytest.fixture(scope="module")
def reference() -> Iterator[Server]:
    """Preemption off: the unparked output."""
    yield from serve_for_module(*flags(1024, 2, 512, "--no-preempt"), "--kv-dtype", "float32")


@pytest.fixture(scope="module")
def parking() -> Iterator[Server]:
    knobs = {"KVPARK_PREEMPT_EVERY": str(EVERY)}
    yield from serve_for_module(*flags(1024, 2, 512), "--kv-dtype", "float32", environ=knobs)


def test_notices_ride_the_anthropic_stream(reference: Server, parking: Server) -> None:
    before = parking.metrics()
    body = ask(STORY, 40)
    unparked = client(reference).messages.create(**body, extra_body=GREEDY)
    assert "preempt" not in unparked.model_dump()  # preemption off: no record
    s = raw_stream(parking, {**body, **GREEDY})
    notices = [c for c in s.comments if c in (": preempted", ": resumed")]
    parks = paired(notices)
    assert parks >= 2  # 40 tokens, a park every 8
    assert s.last("message_delta")["preempt"] == {"parks": parks, "recomputes": 0}
    assert s.text() == text_of(unparked)
    assert s.types[-1] == "message_stop"
    # the anthropic client ignores the comments and assembles the same message
    with client(parking).messages.stream(**body, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert text_of(final) == text_of(unparked) and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 40
    settle(parking, before)


def test_tool_call_and_text_side_by_side_across_parks(reference: Server, parking: Server) -> None:
    before = parking.metrics()
    bodies: list[dict[str, Any]] = [ask(STORY, 32, **GREEDY), {**TOOL_CALL, **GREEDY}]
    expected = [post(reference, b).json() for b in bodies]
    results: list[Any] = [None, None]

    def run(i: int) -> None:
        results[i] = raw_stream(parking, bodies[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    story, call = results
    assert story is not None and call is not None
    assert paired([c for c in story.comments if c in (": preempted", ": resumed")]) >= 1
    assert story.text() == expected[0]["content"][0]["text"]
    arguments = "".join(
        d["delta"]["partial_json"]
        for n, d in call.events
        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    )
    wanted = next(b for b in expected[1]["content"] if b["type"] == "tool_use")
    assert httpx.Response(200, content=arguments).json() == wanted["input"]
    assert call.last("message_delta")["delta"]["stop_reason"] == "tool_use"
    assert call.last("message_delta")["preempt"]["parks"] >= 1
    settle(parking, before)


def test_hanging_up_while_parked_gives_everything_back(parking: Server) -> None:
    before = parking.metrics()
    url = f"{parking.base_url}/v1/messages"
    body = {**ask(STORY, 400), "stream": True}
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == ": preempted":
                break  # hang up while parked
    parking.wait_cells_free()
    # the park's copy back may land before the abort does: then it was resumed
    m = parking.metrics()
    unresumed = parks_of(m) - parks_of(before) - (m[RESUMES] - before[RESUMES])
    assert unresumed in (0, 1)
    settle(parking, before, unresumed=int(unresumed))
    assert client(parking).messages.create(**ask("Hi", 2)).usage.output_tokens == 2
