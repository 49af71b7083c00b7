"""``POST /v1/messages`` (the Anthropic Messages API) with the real ``anthropic`` client.

One real ``kvpark serve`` on the default model, started with an API key: the client sends it as
``x-api-key``, curl-style callers as ``Authorization: Bearer``. The route without a key and over
forced parks is test_messages_api_parks.py; the field walk is test_messages_api_fields.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from support.messages import (
    GREEDY,
    ask,
    assert_anthropic_error,
    client,
    post,
    raw_stream,
    text_of,
)
from support.servers import Server, serve_for_module

KEY = "messages-key"
COUNT = "Count from one to ten in words, separated by commas."
STORY = "Tell me a very long story about a dragon."


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module("--max-model-len", "512", api_key=KEY)


def test_create_returns_a_message(server: Server) -> None:
    message = client(server).messages.create(**ask(COUNT, 12), extra_body=GREEDY)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model.startswith("SmolLM2")
    assert [block.type for block in message.content] == ["text"]
    assert text_of(message).strip()
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 12
    raw = message.model_dump()
    assert raw["timings"]["predicted_n"] == 12  # kvpark's record rides along
    assert raw["preempt"] == {"parks": 0, "recomputes": 0}


def test_end_turn_when_the_model_ends(server: Server) -> None:
    message = client(server).messages.create(**ask("Say hello.", 200), extra_body=GREEDY)
    assert message.stop_reason == "end_turn", text_of(message)
    assert message.usage.output_tokens < 200


def test_stream_assembles_what_create_returns(server: Server) -> None:
    created = client(server).messages.create(**ask(COUNT, 20), extra_body=GREEDY)
    with client(server).messages.stream(**ask(COUNT, 20), extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == text_of(created)
    assert text_of(final) == text_of(created)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 20
    # prompt tokens: the first request computed them all, the second read them from the cache
    total = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert total == created.usage.input_tokens + (created.usage.cache_read_input_tokens or 0)


def test_stream_events_in_anthropic_order(server: Server) -> None:
    s = raw_stream(server, ask(COUNT, 8, **GREEDY))
    head, tail = s.types[:3], s.types[-4:]
    assert head == ["message_start", "ping", "content_block_start"], s.types
    assert tail == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert set(s.types[3:-3]) == {"content_block_delta"}
    start = s.events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    delta = s.last("message_delta")
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 8
    assert delta["preempt"] == {"parks": 0, "recomputes": 0} and "timings" in delta


def test_stop_sequences_name_the_one_that_matched(server: Server) -> None:
    free = text_of(client(server).messages.create(**ask(STORY, 40), extra_body=GREEDY))
    # a word from the middle of the output: the engine stops at its first occurrence
    stop = next(w for w in free.split()[2:] if len(w) >= 3 and free.index(w) > 0)
    message = client(server).messages.create(
        **ask(STORY, 40), stop_sequences=["zebra", stop], extra_body=GREEDY
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == free[: free.index(stop)]
    with client(server).messages.stream(
        **ask(STORY, 40), stop_sequences=[stop], extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_system_and_text_blocks(server: Server) -> None:
    c = client(server)
    plain = c.messages.create(**ask(COUNT, 16), extra_body=GREEDY)
    system = "You answer only in French."
    as_string = c.messages.create(**ask(COUNT, 16), system=system, extra_body=GREEDY)
    as_blocks = c.messages.create(
        **ask(COUNT, 16), system=[{"type": "text", "text": system}], extra_body=GREEDY
    )
    assert text_of(as_string) == text_of(as_blocks) != text_of(plain)
    blocks = [
        {"type": "text", "text": "Count from one to ten"},
        {"type": "text", "text": "in words."},
    ]
    turn: dict[str, Any] = {"role": "user", "content": blocks}
    message = c.messages.create(**(ask("", 8) | {"messages": [turn]}), extra_body=GREEDY)
    assert text_of(message).strip()


def test_tool_results_reach_the_prompt(server: Server) -> None:
    """tool_use and tool_result blocks become chat tool_calls and role-tool turns: the result's
    text, and is_error, are part of the prompt."""

    def prompt_tokens(result: dict[str, object]) -> int:
        turns = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", **result}],
            },
        ]
        body: dict[str, Any] = {"model": "default", "max_tokens": 4, "messages": turns}
        m = client(server).messages.create(**body, extra_body=GREEDY)
        return int(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0))

    sunny = prompt_tokens({"content": "sunny"})
    long = prompt_tokens({"content": [{"type": "text", "text": "sunny, 24 degrees, light wind"}]})
    failed = prompt_tokens({"content": "sunny", "is_error": True})
    assert sunny < long and sunny < failed


# ------------------------------------------------------------------------------------ errors


def test_auth_by_x_api_key_or_bearer(server: Server) -> None:
    body = ask("Hi", 2)
    assert post(server, body, {"x-api-key": KEY}).status_code == 200
    assert post(server, body, {"Authorization": f"Bearer {KEY}"}).status_code == 200
    missing = post(server, body, {"anthropic-version": "2023-06-01"})
    assert_anthropic_error(missing, 401, "authentication_error", "x-api-key")
    wrong = post(server, body, {"x-api-key": "nope"})
    assert_anthropic_error(wrong, 401, "authentication_error", "invalid API key")
    with pytest.raises(anthropic.AuthenticationError):
        client(server, api_key="nope").messages.create(**ask("Hi", 2))
    # the OpenAI routes take x-api-key too, and keep their own error shape
    url = f"{server.base_url}/v1/completions"
    assert (
        httpx.post(
            url, json={"prompt": "Hi", "max_tokens": 1}, headers={"x-api-key": KEY}
        ).status_code
        == 200
    )
    refused = httpx.post(url, json={"prompt": "Hi"}, headers={"x-api-key": "nope"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("body", "status", "kind", "needle"),
    [
        ({**ask("Hi"), "frequency_penalty": 1}, 400, "invalid_request_error", "frequency_penalty"),
        ({**ask("Hi"), "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({**ask("Hi"), "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        (
            {"model": "default", "messages": [{"role": "user", "content": "Hi"}]},
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        ({**ask("Hi"), "model": "claude-sonnet-4-5"}, 404, "not_found_error", "claude-sonnet-4-5"),
        ({**ask("Hi"), "max_tokens": 100000}, 400, "invalid_request_error", "context"),
        (
            ask("Hi")
            | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
            "image",
        ),
        (
            ask("Hi") | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            400,
            "invalid_request_error",
            "web_search_20250305",
        ),
        (
            ask("Hi")
            | {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hel"},
                ]
            },
            400,
            "invalid_request_error",
            "prefill",
        ),
        (
            ask("Hi") | {"stop_sequences": ["a"] * 17},
            400,
            "invalid_request_error",
            "stop_sequences",
        ),
    ],
)
def test_refusals_in_anthropic_shape(
    server: Server, body: dict[str, object], status: int, kind: str, needle: str
) -> None:
    assert_anthropic_error(post(server, body), status, kind, needle)
    streamed = post(server, {**body, "stream": True})  # refused before anything streams
    assert_anthropic_error(streamed, status, kind, needle)


def test_malformed_json_and_wrong_method(server: Server) -> None:
    url = f"{server.base_url}/v1/messages"
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    assert_anthropic_error(
        httpx.post(url, content=b"{not json", headers=headers), 400, "invalid_request_error", "JSON"
    )
    assert_anthropic_error(httpx.get(url, headers=headers), 405, "invalid_request_error", "GET")
    with pytest.raises(anthropic.BadRequestError):
        client(server).messages.create(**ask("Hi", 2), extra_body={"temperature": 2})


def test_a_dropped_stream_gives_its_cells_back(server: Server) -> None:
    key = {"x-api-key": KEY}
    url = f"{server.base_url}/v1/messages"
    body = {**ask(STORY, 400), "stream": True}
    with httpx.stream("POST", url, json=body, headers=key, timeout=60) as response:
        assert response.status_code == 200
        deltas = 0
        for line in response.iter_lines():
            deltas += line == "event: content_block_delta"
            if deltas == 3:
                break  # hang up mid-stream
    time.sleep(0.5)
    server.wait_cells_free()
    assert server.metric("kvpark_requests_running") == 0
    assert client(server).messages.create(**ask("Hi", 2)).usage.output_tokens == 2
