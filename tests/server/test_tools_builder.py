"""ResponseBuilder with a tool plan: the stream the ``openai`` client assembles equals the object.

Engine events are made by hand here (the text a model might write); the server tests run the real
model. The stream is assembled with the ``openai`` package's own ``ChatCompletionStreamState``, the
code behind ``client.chat.completions.stream``.
"""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

import kvpark
from kvpark.engine.outputs import FinishedEvent, TokenEvent
from kvpark.server.responses import ResponseBuilder
from kvpark.server.tools import ToolPlan, plan_tools
from kvpark.tokenizer.tokenizer import Tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TEXT = (
    'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return kvpark.load_tokenizer(None)


def plan() -> ToolPlan:
    result = plan_tools([{"role": "user", "content": "hi"}], TOOLS, "auto", None, "plain")
    assert result is not None
    return result


def events(text: str, reason: str, step: int) -> list[TokenEvent]:
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    last = len(pieces) - 1
    return [
        TokenEvent(0, p, [0], None, reason if i == last else None) for i, p in enumerate(pieces)
    ]


def build(tokenizer: Tokenizer, tools: ToolPlan | None) -> ResponseBuilder:
    return ResponseBuilder("chat", "chatcmpl-1", "m", 1, 1, tokenizer, tools=tools)


FINISHED = FinishedEvent(3, 9, 1.0, 1.0)


@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_assembles_to_the_response(tokenizer: Tokenizer, step: int) -> None:
    whole = build(tokenizer, plan())
    for event in events(TEXT, "stop", step):
        whole.on_tokens(0, event)
    whole.on_finished(FINISHED)
    response = whole.response()
    choice = response["choices"][0]  # type: ignore[index]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    calls = message["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)

    streamed = build(tokenizer, plan())
    state = ChatCompletionStreamState(input_tools=TOOLS)  # type: ignore[arg-type]
    chunks = []
    for event in events(TEXT, "stop", step):
        chunks.extend(streamed.on_tokens(0, event))
    streamed.on_finished(FINISHED)
    chunks.extend(streamed.closing_chunks())
    for chunk in chunks:
        assert "<tool" not in json.dumps(
            chunk.get("choices", [{}])[0].get("delta", {}).get("content")
        )
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.content == "Checking."
    got = [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []]
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert got == want


def test_no_text_means_null_content(tokenizer: Tokenizer) -> None:
    builder = build(tokenizer, plan())
    for event in events(TEXT.removeprefix("Checking. "), "stop", 5):
        builder.on_tokens(0, event)
    message = builder.response()["choices"][0]["message"]  # type: ignore[index]
    assert message["content"] is None and len(message["tool_calls"]) == 2


def test_cut_by_length_keeps_length(tokenizer: Tokenizer) -> None:
    builder = build(tokenizer, plan())
    for event in events(TEXT[:60], "length", 4):
        builder.on_tokens(0, event)
    choice = builder.response()["choices"][0]  # type: ignore[index]
    assert choice["finish_reason"] == "length"


def test_without_a_plan_text_is_untouched(tokenizer: Tokenizer) -> None:
    builder = build(tokenizer, None)
    for event in events(TEXT, "stop", 4):
        builder.on_tokens(0, event)
    choice = builder.response()["choices"][0]  # type: ignore[index]
    assert choice["message"] == {"role": "assistant", "content": TEXT}
    assert choice["finish_reason"] == "stop"
