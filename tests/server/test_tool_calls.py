"""Tool calling on a real ``kvpark serve`` with the real ``openai`` client (docs/tool-calls.md).

Three servers, each started once for the module, all on the default model (SmolLM2-135M):

- ``generic``: the model's own template, which has no tool syntax: the generic format, whose
  ``auto`` is a grammar too. Exact mode, so a request's output is the same whatever runs beside it.
- ``hermes``: ``--chat-template tests/data/hermes_tools.jinja``, a Hermes-style template written
  for these tests: the template lists the tools and renders the tool turns itself.
- ``parked``: as ``generic`` but every generating request is parked every 16 tokens and every park
  recomputes (``KVPARK_PREEMPT_EVERY``, ``KVPARK_PREEMPT_FAIL_SAVE``): the grammar state must come
  through a replay unchanged.

``required`` and a named function are enforced by the grammar, so even this small model returns
calls whose arguments validate against the tool's schema.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from support.servers import Server, serve_for_module

TEMPLATE = Path(__file__).parent.parent / "data" / "hermes_tools.jinja"
SAME = ("--kv-dtype", "float32", "--no-prefix-cache", "--exact")
UNITS = ["celsius", "fahrenheit"]
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": UNITS}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
GREEDY: dict[str, Any] = {"model": "default", "temperature": 0, "max_tokens": 48}


@pytest.fixture(scope="module")
def generic() -> Iterator[Server]:
    yield from serve_for_module(*SAME)


@pytest.fixture(scope="module")
def hermes() -> Iterator[Server]:
    yield from serve_for_module("--chat-template", str(TEMPLATE))


@pytest.fixture(scope="module")
def parked() -> Iterator[Server]:
    knobs = {"KVPARK_PREEMPT_EVERY": "16", "KVPARK_PREEMPT_FAIL_SAVE": "1"}
    yield from serve_for_module(*SAME, environ=knobs)


def client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


def valid_call(name: str, arguments: str) -> dict[str, Any]:
    """The call's arguments, checked against its tool's schema (the two the tests use)."""
    args = json.loads(arguments)
    assert isinstance(args, dict)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in UNITS
    else:
        assert name == "get_time" and set(args) == {"city"}
    assert isinstance(args["city"], str)
    return args


def ask(server: Server, stream: bool, **body: Any) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of one chat request, streamed or not; a stream
    is assembled by the openai client's own stream helper."""
    openai = client(server)
    options = {**GREEDY, "messages": ASK, **body}
    if not stream:
        choice = openai.chat.completions.create(**options).choices[0]
        message = choice.message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert all(c.id.startswith("call_") for c in message.tool_calls or [])
        return message.content, calls, choice.finish_reason
    with openai.chat.completions.stream(**options) as events:
        for _ in events:
            pass
        final = events.get_final_completion().choices[0]
    calls = [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []]
    return final.message.content, calls, final.finish_reason


def test_default_template_is_generic_and_hermes_renders_tools(
    generic: Server, hermes: Server
) -> None:
    """tool_choice none: the prompt leaves the tools out (the same prompt as no tools at all)."""
    plain = ask(generic, False)
    assert ask(generic, False, tools=TOOLS, tool_choice="none") == plain
    assert plain[1] == [] and plain[0]
    # the Hermes template lists them: the same request with tools gets a longer prompt
    with hermes.client() as http:
        bare = http.post("/v1/chat/completions", json={**GREEDY, "messages": ASK}).json()
        listed = http.post(
            "/v1/chat/completions", json={**GREEDY, "messages": ASK, "tools": TOOLS}
        ).json()
    assert listed["usage"]["prompt_tokens"] > bare["usage"]["prompt_tokens"] + 50


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("which", ["generic", "hermes"])
def test_two_step_tool_loop(which: str, stream: bool, request: pytest.FixtureRequest) -> None:
    server: Server = request.getfixturevalue(which)
    openai = client(server)
    first = ask(server, stream, tools=TOOLS, tool_choice=NAMED)
    content, calls, reason = first
    assert reason == "tool_calls" and content is None
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    valid_call(*calls[0])
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": calls[0][0], "arguments": calls[0][1]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "degrees": 21}'},
    ]
    second = openai.chat.completions.create(
        **{**GREEDY, "max_tokens": 32}, messages=history, tools=TOOLS, tool_choice="none"
    )
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert "<tool_call>" not in answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # the result reached the prompt: a longer result, a longer prompt
    longer = [*history[:2], {**history[2], "content": history[2]["content"] * 4}]
    again = openai.chat.completions.create(
        **{**GREEDY, "max_tokens": 1}, messages=longer, tools=TOOLS, tool_choice="none"
    )
    assert second.usage is not None and again.usage is not None
    assert again.usage.prompt_tokens > second.usage.prompt_tokens + 20


@pytest.mark.parametrize("which", ["generic", "hermes"])
def test_streamed_calls_equal_the_non_streamed(which: str, request: pytest.FixtureRequest) -> None:
    server: Server = request.getfixturevalue(which)
    body = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    whole = ask(server, False, **body)
    assert whole == ask(server, True, **body)
    assert whole[2] == "tool_calls" and len(whole[1]) == 1
    valid_call(*whole[1][0])


def test_streamed_pieces_are_shaped_as_openai_sends_them(generic: Server) -> None:
    """First piece: index, id, type, name; then only argument fragments; no tag in content."""
    body = {**GREEDY, "messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "stream": True}
    pieces: list[dict[str, Any]] = []
    with generic.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    assert "<tool" not in (choice["delta"].get("content") or "")
                    pieces.extend(choice["delta"].get("tool_calls", []))
    assert pieces[0]["id"].startswith("call_") and pieces[0]["type"] == "function"
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["index"] == 0
    rest = pieces[1:]
    assert len(rest) > 1 and all(set(p) == {"index", "function"} for p in rest)
    arguments = "".join(p["function"]["arguments"] for p in pieces)
    valid_call("get_weather", arguments)


def test_parallel_tool_calls(generic: Server) -> None:
    ask_both = [{"role": "user", "content": "What are the weather and the time in Paris?"}]
    body = {"messages": ask_both, "tools": TOOLS, "tool_choice": "required", "max_tokens": 96}
    _, calls, _ = ask(generic, False, **body)
    assert len(calls) >= 2  # the grammar lets calls follow calls
    for name, arguments in calls[:-1]:  # the last may be cut by max_tokens
        valid_call(name, arguments)
    _, single, reason = ask(generic, False, **body, parallel_tool_calls=False)
    assert len(single) == 1 and reason == "tool_calls"
    valid_call(*single[0])


def test_auto_returns_text_or_valid_calls(generic: Server, hermes: Server) -> None:
    for server in (generic, hermes):
        content, calls, reason = ask(server, False, tools=TOOLS, tool_choice="auto")
        if calls:
            assert reason == "tool_calls"
            for call in calls:
                valid_call(*call)
        else:
            assert content and "<tool_call>" not in content


def test_beside_other_requests_and_across_parks(generic: Server, parked: Server) -> None:
    """A tool request and a plain one side by side: each the same as alone, and the same again
    when every request is parked and recomputed every 16 tokens (a replay recomputes the tools'
    long system turn: the neighbours are kept short)."""
    tools_body = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    story = [{"role": "user", "content": "Tell me a story."}]
    plain_body: dict[str, Any] = {"messages": story, "max_tokens": 20}
    auto_body: dict[str, Any] = {"tools": TOOLS, "max_tokens": 20}
    alone = {
        "tools": ask(generic, False, **tools_body),
        "tools_stream": ask(generic, True, **tools_body),
        "auto": ask(generic, False, **auto_body),
        "plain": ask(generic, False, **plain_body),
    }
    for server in (generic, parked):
        together: dict[str, Any] = {}

        def run(
            key: str,
            stream: bool,
            body: dict[str, Any],
            server: Server = server,
            out: dict[str, Any] = together,
        ) -> None:
            out[key] = ask(server, stream, **body)

        threads = [
            threading.Thread(target=run, args=("tools", False, tools_body)),
            threading.Thread(target=run, args=("tools_stream", True, tools_body)),
            threading.Thread(target=run, args=("auto", False, auto_body)),
            threading.Thread(target=run, args=("plain", False, plain_body)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert together == alone
    with parked.client() as http:
        body = {**GREEDY, "messages": ASK, **tools_body}
        out = http.post("/v1/chat/completions", json=body).json()
    assert out["preempt"]["parks"] > 0 and out["preempt"]["recomputes"] > 0
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    parked.wait_cells_free()


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    # a schema the grammar compiler refuses, found before anything streams
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
            "tool_choice": "required",
            "stream": True,
        },
        "tools",
    ),
    (
        {
            "tools": TOOLS,
            "messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "x"}}]}],
        },
        "messages",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
@pytest.mark.parametrize("which", ["generic", "hermes"])
def test_bad_tool_fields_are_400s_naming_them(
    which: str, fields: dict[str, Any], param: str, request: pytest.FixtureRequest
) -> None:
    server: Server = request.getfixturevalue(which)
    body = {**GREEDY, "messages": ASK, **fields}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["param"] == param
    server.wait_cells_free()
    # still serving
    assert ask(server, False, max_tokens=4)[2] in ("stop", "length")
