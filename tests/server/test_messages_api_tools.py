"""Tool use on ``POST /v1/messages`` with the real ``anthropic`` client: a two-step loop.

The default model's template has no tool syntax, so the generic format runs: the tools are
described in the system turn, and ``tool_choice`` ``any`` / ``tool`` are enforced with the grammar,
so even the 135M model returns a valid call. The call comes back as a ``tool_use`` block (its
``input`` an object), streamed as ``input_json_delta``\\ s that the client assembles, with
``stop_reason: "tool_use"``; the ``tool_result`` continues the conversation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from support.messages import GREEDY, ask, client, raw_stream, text_of
from support.servers import Server, serve_for_module

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "description": "The local time in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "additionalProperties": False,
    },
}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module("--max-model-len", "1024")


def forced(**more: Any) -> dict[str, Any]:
    """A request that must call get_weather (``more`` may override the tool_choice)."""
    choice = {"type": "tool", "name": "get_weather"}
    return ask(QUESTION, 160, tools=[WEATHER, TIME], tool_choice=choice) | more


def test_named_tool_is_a_valid_call(server: Server) -> None:
    message = client(server).messages.create(**forced(), extra_body=GREEDY)
    assert message.stop_reason == "tool_use", message
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) >= 1 and calls[0].name == "get_weather"
    assert isinstance(calls[0].input, dict) and isinstance(calls[0].input.get("city"), str)
    assert calls[0].id


def test_any_forces_one_call_without_parallel_use(server: Server) -> None:
    choice = {"type": "any", "disable_parallel_tool_use": True}
    body = ask(QUESTION, 160, tools=[WEATHER, TIME], tool_choice=choice)
    message = client(server).messages.create(**body, extra_body=GREEDY)
    assert message.stop_reason == "tool_use"
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time")


def test_none_gives_text(server: Server) -> None:
    body = ask(QUESTION, 24, tools=[WEATHER], tool_choice={"type": "none"})
    message = client(server).messages.create(**body, extra_body=GREEDY)
    assert [b.type for b in message.content] == ["text"] and message.stop_reason == "max_tokens"


def test_streamed_call_assembles_to_the_same_input(server: Server) -> None:
    created = client(server).messages.create(**forced(), extra_body=GREEDY)
    with client(server).messages.stream(**forced(), extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"

    def calls(message: Any) -> list[tuple[str, Any]]:  # ids are fresh per request
        return [(b.name, b.input) for b in message.content if b.type == "tool_use"]

    assert calls(final) == calls(created) and calls(final)
    raw = raw_stream(server, {**forced(), **GREEDY})
    starts = [d["content_block"] for n, d in raw.events if n == "content_block_start"]
    assert any(b["type"] == "tool_use" and b["input"] == {} for b in starts), starts
    pieces = [d["delta"] for n, d in raw.events if n == "content_block_delta"]
    assert any(p["type"] == "input_json_delta" for p in pieces)
    assert raw.last("message_delta")["delta"]["stop_reason"] == "tool_use"


def test_two_step_tool_loop(server: Server) -> None:
    c = client(server)
    first = c.messages.create(**forced(), extra_body=GREEDY)
    call = next(b for b in first.content if b.type == "tool_use")
    turns: list[Any] = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 degrees."}
            ],
        },
    ]
    body: dict[str, Any] = {
        "model": "default",
        "max_tokens": 48,
        "messages": turns,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "none"},
    }
    second = c.messages.create(**body, extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert text_of(second).strip()
    with c.messages.stream(**body, extra_body=GREEDY) as stream:
        assert text_of(stream.get_final_message()) == text_of(second)


def test_a_call_cut_short_is_max_tokens(server: Server) -> None:
    message = client(server).messages.create(**forced(max_tokens=20), extra_body=GREEDY)
    assert message.stop_reason == "max_tokens"
    block = next(b for b in message.content if b.type == "tool_use")
    assert block.input == {} and block.model_dump()["partial_input"]
