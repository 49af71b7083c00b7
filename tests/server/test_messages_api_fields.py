"""The field walk of ``POST /v1/messages``: every field ``MessagesBody`` declares changes the
output, is refused with a 400 that names it, or is a declared no-op that changes nothing.

A new field without a case here fails :func:`test_every_field_has_a_case`. The server runs
without an API key (the route's other tests run with one). "Output" is what a field could change:
the content blocks, the stop reason and the prompt's length in tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpark.server.messages_api_body import MessagesBody
from support.messages import ask, assert_anthropic_error, post
from support.servers import Server, serve_for_module

STORY = "Tell me a very long story about a dragon."
BASE = ask(STORY, 24, temperature=0)
SAMPLED = {**BASE, "temperature": 1.0}
TOOL = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

# field -> (body, reference): the field's value changes the output from the reference's
CHANGES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "max_tokens": ({**BASE, "max_tokens": 8}, BASE),
    "messages": (ask("Name three colours.", 24, temperature=0), BASE),
    "system": ({**BASE, "system": "You only ever answer with the word no."}, BASE),
    "temperature": (SAMPLED, BASE),
    "top_p": ({**SAMPLED, "top_p": 0.01}, SAMPLED),
    "top_k": ({**SAMPLED, "top_k": 1}, SAMPLED),
    "tools": ({**BASE, "tools": [TOOL]}, BASE),
    "tool_choice": (
        {**BASE, "tools": [TOOL], "tool_choice": {"type": "any"}},
        {**BASE, "tools": [TOOL]},
    ),
}
# field -> a value refused with a 400 whose message names the field
REFUSED: dict[str, tuple[Any, str]] = {
    "model": ("claude-sonnet-4-5", "claude-sonnet-4-5"),  # 404: another model
    "thinking": ({"type": "enabled", "budget_tokens": 1024}, "thinking"),
    "output_config": ({"effort": "high"}, "effort"),
}
# field -> a value accepted that changes nothing (by nature, documented in docs/server.md)
NO_OPS: dict[str, Any] = {
    "metadata": {"user_id": "user-1"},
    "service_tier": "auto",
    "inference_geo": "us",
    "speed": "fast",
    "cache_control": {"type": "ephemeral"},
    "thinking": {"type": "disabled"},
}
# the rest have their own test below (cache_salt: in tests/server/test_cache_salt.py, since it
# changes only which cached pages a request may take)
OWN_TESTS = {"stop_sequences", "stream", "output_config", "cache_salt"}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module("--max-model-len", "1024")


def output(server: Server, body: dict[str, Any]) -> tuple[object, ...]:
    response = post(server, body)
    assert response.status_code == 200, response.text
    m = response.json()
    prompt = m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"]
    return json.dumps(m["content"]), m["stop_reason"], prompt


def test_every_field_has_a_case() -> None:
    walked = set(CHANGES) | set(REFUSED) | set(NO_OPS) | OWN_TESTS
    assert walked == set(MessagesBody.model_fields)


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_field_changes_the_output(server: Server, field: str) -> None:
    body, reference = CHANGES[field]
    assert output(server, body) != output(server, reference)


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_field_is_refused(server: Server, field: str) -> None:
    value, needle = REFUSED[field]
    status, kind = (404, "not_found_error") if field == "model" else (400, "invalid_request_error")
    assert_anthropic_error(post(server, {**BASE, field: value}), status, kind, needle)


@pytest.mark.parametrize("field", sorted(NO_OPS))
def test_declared_no_op_changes_nothing(server: Server, field: str) -> None:
    assert output(server, {**BASE, field: NO_OPS[field]}) == output(server, BASE)


def test_stop_sequences(server: Server) -> None:
    text = json.loads(str(output(server, BASE)[0]))[0]["text"]
    stop = next(w for w in text.split()[2:] if len(w) >= 3 and text.index(w) > 0)
    stopped = post(server, {**BASE, "stop_sequences": [stop]}).json()
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == stop
    assert stopped["content"][0]["text"] == text[: text.index(stop)]


def test_stream(server: Server) -> None:
    url = f"{server.base_url}/v1/messages"
    with httpx.stream("POST", url, json={**BASE, "stream": True}, timeout=300) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[0] == "event: message_start" and lines[-2] == "event: message_stop"


def test_output_config_format_is_a_json_schema(server: Server) -> None:
    body = {
        **ask("Describe a person as JSON.", 64, temperature=0),
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
    }
    message = post(server, body).json()
    value = json.loads(message["content"][0]["text"])
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert message["stop_reason"] == "end_turn"
    bad = {**body, "output_config": {"format": {"type": "json_schema", "schema": {"type": 5}}}}
    assert_anthropic_error(post(server, bad), 400, "invalid_request_error", "output_config")
