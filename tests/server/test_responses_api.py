"""``POST /v1/responses`` on a real ``kvpark serve`` with the real ``openai`` client.

The route is the chat path under another body and other events, so most checks compare it with
``/v1/chat/completions`` on the same server at temperature 0: the same conversation must give the
same text and the same token counts. The prefix cache is off so the two runs compute the same
prompt the same way. Tool calls and ``text.format`` are in test_responses_api_tools.py, parks and
disconnects in test_responses_api_parks.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from kvpark.server.responses_api_body import ResponsesBody
from support.servers import Server, serve_for_module

QUESTION = "Write one sentence about the sea."
GREEDY = {"model": "default", "input": QUESTION, "max_output_tokens": 16, "temperature": 0.0}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module("--no-prefix-cache")


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(server: Server, messages: list[dict[str, Any]], max_tokens: int = 16) -> dict[str, Any]:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/responses", json=body, timeout=120)


def text_of(server: Server, body: dict[str, Any]) -> str:
    response = post(server, body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["object"] == "response" and out["status"] in ("completed", "incomplete"), out
    text: str = out["output_text"]
    return text


# ------------------------------------------------------------------------------ plain requests


def test_text_input_is_a_user_turn(server: Server, client: openai.OpenAI) -> None:
    r = client.responses.create(**GREEDY)  # type: ignore[call-overload]
    reference = chat(server, [{"role": "user", "content": QUESTION}])
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == reference["choices"][0]["message"]["content"] != ""
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    assert [part.type for part in item.content] == ["output_text"]
    assert r.usage is not None
    assert r.usage.input_tokens == reference["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == reference["usage"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0  # the cache is off here
    assert r.model == client.models.list().data[0].id


def test_instructions_and_message_items(server: Server, client: openai.OpenAI) -> None:
    """``instructions`` is the system turn first; items keep their roles (developer: system);
    content parts are joined, an earlier ``output_text`` part included."""
    r = client.responses.create(
        model="default",
        instructions="You are a pirate.",
        input=[
            {"role": "user", "content": "Hello!"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Ahoy!", "annotations": []}],
            },
            {"role": "developer", "content": "Answer in five words."},
            {"role": "user", "content": [{"type": "input_text", "text": "Where is the ship?"}]},
        ],
        max_output_tokens=12,
        temperature=0,
    )
    reference = chat(
        server,
        [
            {"role": "system", "content": "You are a pirate."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Ahoy!"},
            {"role": "system", "content": "Answer in five words."},
            {"role": "user", "content": "Where is the ship?"},
        ],
        max_tokens=12,
    )
    assert r.output_text == reference["choices"][0]["message"]["content"]
    assert r.usage is not None and r.usage.input_tokens == reference["usage"]["prompt_tokens"]
    assert r.instructions == "You are a pirate."


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(**{**GREEDY, "max_output_tokens": 3})  # type: ignore[call-overload]
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    assert r.output[0].status == "incomplete"


def test_a_short_answer_completes(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="default", input="Say yes.", max_output_tokens=200, temperature=0
    )
    assert r.status == "completed" and r.incomplete_details is None
    assert r.usage is not None and 0 < r.usage.output_tokens < 200


# ------------------------------------------------------------------------------ streaming


def test_stream_events_build_the_same_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(**GREEDY)  # type: ignore[call-overload]
    events = list(client.responses.create(**GREEDY, stream=True))  # type: ignore[call-overload]
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert {e.item_id for e in events[3:-2] if hasattr(e, "item_id")} == {item_id}
    assert events[-4].text == streamed  # output_text.done has the whole text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.output[0].id == item_id
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_wire_format(server: Server) -> None:
    """Typed SSE: every data line after an ``event:`` line naming its type; no ``[DONE]``; the
    last object carries usage, timings and the preempt record."""
    with httpx.stream(
        "POST", server.base_url + "/v1/responses", json={**GREEDY, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert "data: [DONE]" not in lines
    data = [line for line in lines if line.startswith("data: ")]
    assert len(data) * 2 == len(lines)
    for event_line, data_line in zip(lines[::2], lines[1::2], strict=True):
        obj = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {obj['type']}"
    final = json.loads(data[-1].removeprefix("data: "))["response"]
    assert final["usage"]["output_tokens"] == final["timings"]["predicted_n"]
    assert final["preempt"] == {"parks": 0, "recomputes": 0}


# ------------------------------------------------------------------------------ refusals


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),  # no such stored response
    ({"background": True, "store": False}, "background"),  # it is read back by its id
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),  # not a Responses field
    ({"temperature": "hot"}, "temperature"),
    ({"max_output_tokens": 2.5}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"top_p": 7.0}, "top_p"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.message.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.message"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format.json_schema.name"),
    ({"stream": "yes"}, "stream"),
]


@pytest.mark.parametrize(("change", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_refused_with_a_400_naming_the_field(
    server: Server, client: openai.OpenAI, change: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        # extra_body: the client's own checks would stop some of these before they are sent
        client.responses.create(**GREEDY, extra_body=change)  # type: ignore[call-overload]
    body = caught.value.body
    assert isinstance(body, dict), body
    # the context overflow has its own type, as on the chat route
    assert body["type"] in ("invalid_request_error", "exceed_context_size_error"), body
    assert body["param"] is not None and body["param"].startswith(param), body
    assert caught.value.status_code == 400 == body["code"]
    server.wait_cells_free()  # nothing held; the next request is served
    assert text_of(server, {**GREEDY, "max_output_tokens": 2})


def test_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(**{**GREEDY, "model": "gpt-9"})  # type: ignore[call-overload]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "model"


# ------------------------------------------------------------------------------ the field walk

Check = Callable[[Server, str], None]


def differs(change: dict[str, Any]) -> Check:
    def check(server: Server, baseline: str) -> None:
        assert text_of(server, {**GREEDY, **change}) != baseline, change

    return check


def same(change: dict[str, Any]) -> Check:
    def check(server: Server, baseline: str) -> None:
        assert text_of(server, {**GREEDY, **change}) == baseline, change

    return check


def refused(change: dict[str, Any], status: int = 400) -> Check:
    def check(server: Server, baseline: str) -> None:
        response = post(server, {**GREEDY, **change})
        assert response.status_code == status, response.text

    return check


def streams(server: Server, baseline: str) -> None:
    response = post(server, {**GREEDY, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "event: response.completed" in response.text or "response.incomplete" in response.text


def in_background(server: Server, baseline: str) -> None:
    queued = post(server, {**GREEDY, "background": True}).json()
    assert queued["status"] in ("queued", "in_progress") and queued["background"] is True
    url = f"{server.base_url}/v1/responses/{queued['id']}"
    while (done := httpx.get(url, timeout=120).json())["status"] in ("queued", "in_progress"):
        time.sleep(0.05)
    assert done["output_text"] == baseline


def top_p_keeps_the_top_token(server: Server, baseline: str) -> None:
    # temperature 1 samples; a top_p this small leaves the one likeliest token: greedy again
    assert text_of(server, {**GREEDY, "temperature": 1.0, "top_p": 1e-6}) == baseline
    assert text_of(server, {**GREEDY, "temperature": 0.0, "top_p": 0.5}) == baseline


FIELD_WALK: dict[str, list[Check]] = {
    "model": [refused({"model": "other-model"}, 404), same({"model": None})],
    "input": [differs({"input": "Name a colour."})],
    "instructions": [differs({"instructions": "Answer only in French."})],
    "max_output_tokens": [differs({"max_output_tokens": 4})],
    "temperature": [differs({"temperature": 2.0})],
    "top_p": [top_p_keeps_the_top_token],
    "stream": [streams, same({"stream": False})],
    # kept or not, the same text (reading them back: test_responses_store.py)
    "store": [same({"store": True}), same({"store": False})],
    "previous_response_id": [refused({"previous_response_id": "resp_1"})],
    "background": [in_background, same({"background": False})],
    "reasoning": [refused({"reasoning": {}})],
    "include": [refused({"include": ["reasoning.encrypted_content"]}), same({"include": []})],
    "top_logprobs": [refused({"top_logprobs": 0})],
    "truncation": [refused({"truncation": "auto"}), same({"truncation": "disabled"})],
    # the declared no-ops: they change no output by nature
    "metadata": [same({"metadata": {"k": "v"}})],
    "user": [same({"user": "someone"})],
    "service_tier": [same({"service_tier": "auto"})],
    # changes which cached pages it may take, never the text (tests/server/test_cache_salt.py)
    "cache_salt": [same({"cache_salt": "tenant-a"}), refused({"cache_salt": ""})],
}
# walked in test_responses_api_tools.py (they need the grammar and the tool plan)
WALKED_WITH_TOOLS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "text"})


def test_the_walk_covers_every_field() -> None:
    assert set(FIELD_WALK) | WALKED_WITH_TOOLS == set(ResponsesBody.model_fields)
    assert not set(FIELD_WALK) & WALKED_WITH_TOOLS


@pytest.mark.parametrize("field", sorted(FIELD_WALK))
def test_field_walk(server: Server, field: str) -> None:
    baseline = text_of(server, GREEDY)
    for check in FIELD_WALK[field]:
        check(server, baseline)
