"""``/v1/responses`` with tools and ``text.format``, on the default model, with the real ``openai``
client: the chat path's tool plan and grammar (the tools, grammar and bodies branches) under the
Responses items and events.

The default model's template has no tool syntax, so its calls come in the generic format, and
``required`` or a named function is enforced with the grammar: even the 135M model returns a
valid call. Also the rest of the field walk of test_responses_api.py: ``tools``, ``tool_choice``,
``parallel_tool_calls`` and ``text`` each change the output as they should. And a call streamed
across forced parks (a second server parks every request every 8 tokens) is the unparked call.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from support.preempt_server import EVERY, flags, paired
from support.servers import Server, serve_for_module

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
# strict: the grammar holds the arguments to the schema, so the small model's calls end
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": CITY,
    "strict": True,
}
TIME = {**WEATHER, "name": "get_time", "description": "The local time in a city."}
# one call: with parallel calls allowed the small model goes on calling until its limit
ONE_CALL = {"tool_choice": "required", "parallel_tool_calls": False}
AFTER = {"tools": [WEATHER], "tool_choice": "none"}
ASK = "What is the weather in Paris?"
BASE: dict[str, Any] = {"model": "default", "max_output_tokens": 64, "temperature": 0.0}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module("--no-prefix-cache")


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def calls_of(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]


def test_required_returns_a_valid_call(client: openai.OpenAI) -> None:
    r = client.responses.create(**BASE, input=ASK, tools=[WEATHER, TIME], **ONE_CALL)
    [call] = calls_of(r)
    assert call.name in ("get_weather", "get_time")
    assert set(json.loads(call.arguments)) == {"city"}
    assert call.call_id and call.id and call.id.startswith("fc_")
    assert r.status == "completed" and r.output_text == ""
    assert r.tool_choice == "required" and [t.name for t in r.tools] == ["get_weather", "get_time"]


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    r = client.responses.create(
        **BASE,
        input=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_time"},
    )
    assert [c.name for c in calls_of(r)] == ["get_time"]


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    """The small model, allowed several calls, makes more than one; ``false`` stops it at one."""
    both = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    several = client.responses.create(**BASE, input=ASK, **both)
    one = client.responses.create(**BASE, input=ASK, **both, parallel_tool_calls=False)
    assert len(calls_of(several)) > 1
    assert len(calls_of(one)) == 1 and one.parallel_tool_calls is False


def test_tool_choice_none_writes_text(client: openai.OpenAI) -> None:
    r = client.responses.create(**BASE, input=ASK, tools=[WEATHER], tool_choice="none")
    assert calls_of(r) == [] and r.output_text


def test_tools_change_the_prompt(client: openai.OpenAI) -> None:
    """The generic format describes the tools in the system turn: more input tokens."""
    plain = client.responses.create(**BASE, input=ASK)
    with_tools = client.responses.create(**BASE, input=ASK, tools=[WEATHER])
    assert plain.usage is not None and with_tools.usage is not None
    assert with_tools.usage.input_tokens > plain.usage.input_tokens


def test_streamed_call_events(client: openai.OpenAI) -> None:
    whole = client.responses.create(**BASE, input=ASK, tools=[WEATHER], **ONE_CALL)
    events = list(
        client.responses.create(**BASE, input=ASK, tools=[WEATHER], **ONE_CALL, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added[0].item.type == "function_call" and added[0].item.name == "get_weather"
    item_id = added[0].item.id
    pieces = [
        e.delta
        for e in events
        if e.type == "response.function_call_arguments.delta" and e.item_id == item_id
    ]
    [done] = [
        e
        for e in events
        if e.type == "response.function_call_arguments.done" and e.item_id == item_id
    ]
    assert "".join(pieces) == done.arguments == calls_of(whole)[0].arguments
    # each item is done before the next one is added
    order = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item.")]
    for i in range(1, len(order) // 2):
        assert order.index(("response.output_item.done", i - 1)) < order.index(
            ("response.output_item.added", i)
        )
    assert calls_of(events[-1].response)[0].arguments == done.arguments


def tool_loop(client: openai.OpenAI, stream: bool) -> tuple[str, int, int]:
    """Two steps: a required call, then the call and its result back in ``input``, with
    ``tool_choice: none`` for the answer (left to ``auto``, the small model calls again)."""
    first = client.responses.create(**BASE, input=ASK, tools=[WEATHER], **ONE_CALL)
    [call] = calls_of(first)
    history: list[Any] = [{"role": "user", "content": ASK}, *first.output]
    history.append(
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    )
    if stream:
        events = list(client.responses.create(**BASE, input=history, **AFTER, stream=True))
        second = events[-1].response
    else:
        second = client.responses.create(**BASE, input=history, **AFTER)
    assert first.usage is not None and second.usage is not None
    assert calls_of(second) == [] and second.status == "completed"
    # the same settings with the question alone: the call and its result add to the prompt
    alone = client.responses.create(**{**BASE, "max_output_tokens": 1}, input=ASK, **AFTER)
    assert alone.usage is not None
    return second.output_text, alone.usage.input_tokens, second.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_two_step_tool_loop_beside_other_requests(client: openai.OpenAI, stream: bool) -> None:
    others: list[str] = []

    def chat() -> None:
        r = client.responses.create(**BASE, input="Count to five.")
        others.append(r.output_text)

    threads = [threading.Thread(target=chat) for _ in range(2)]
    for thread in threads:
        thread.start()
    text, alone_in, second_in = tool_loop(client, stream)
    for thread in threads:
        thread.join(300)
    assert len(others) == 2 and all(others)  # served beside the loop
    assert second_in > alone_in  # the call and its result are in the second prompt
    assert text  # the model answers in text once it has the result


def test_json_schema_format(client: openai.OpenAI) -> None:
    r = client.responses.create(
        **BASE,
        input="Invent a person.",
        text={
            "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
        },
    )
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert r.text is not None and r.text.format.type == "json_schema"


def test_json_object_format(client: openai.OpenAI) -> None:
    r = client.responses.create(
        **{**BASE, "max_output_tokens": 128},
        input="Give me a JSON object with the key 'colour' set to a colour.",
        text={"format": {"type": "json_object"}},
    )
    assert r.status == "completed"
    assert isinstance(json.loads(r.output_text), dict)


def test_a_bad_schema_is_a_400_naming_text_format(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            **BASE,
            input="x",
            text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "banana"}}},
        )
    body = caught.value.body
    assert isinstance(body, dict) and str(body["param"]).startswith("text.format"), body


@pytest.fixture(scope="module")
def swap_every() -> Iterator[Server]:
    """Every generating request parked (swapped) every 8 tokens."""
    knobs = {"KVPARK_PREEMPT_EVERY": str(EVERY)}
    yield from serve_for_module(*flags(1024, 2, 512), "--no-prefix-cache", environ=knobs)


def test_a_streamed_call_across_forced_parks(client: openai.OpenAI, swap_every: Server) -> None:
    """The grammar state parks with the request: the call is the unparked one."""
    unparked = client.responses.create(**BASE, input=ASK, tools=[WEATHER], **ONE_CALL)
    body = {**BASE, "input": ASK, "tools": [WEATHER], **ONE_CALL, "stream": True}
    with httpx.stream("POST", swap_every.base_url + "/v1/responses", json=body, timeout=400) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    parks = paired([line for line in lines if line in (": preempted", ": resumed")])
    assert parks >= 2  # a call of ~30 tokens, a park every 8
    final = json.loads(lines[-1].removeprefix("data: "))
    assert final["type"] == "response.completed"
    assert final["response"]["preempt"]["parks"] == parks
    [call] = [item for item in final["response"]["output"] if item["type"] == "function_call"]
    assert (call["name"], call["arguments"]) == (
        calls_of(unparked)[0].name,
        calls_of(unparked)[0].arguments,
    )
    swap_every.wait_cells_free()
