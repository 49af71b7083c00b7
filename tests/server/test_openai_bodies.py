"""The chat and completions bodies reach the request as they should: the parsing half of the field
walk, against the default model's real tokenizer and chat template.

``tests/server/test_field_walk.py`` proves each field changes a real server's output; this file
pins what each one becomes on the :class:`GenerationRequest` (the constraint of every structured-
output spelling, the extensions' params, the message fields the tools layer renders) and the
refusals that need no model to run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpark.model.loader import load_tokenizer
from kvpark.sampling.params import Constraint
from kvpark.server.errors import APIError
from kvpark.server.protocol import TokenizerLike, parse_chat, parse_completion
from kvpark.tokenizer.tokenizer import Tokenizer

HI = [{"role": "user", "content": "Hi"}]
HERMES = Path(__file__).resolve().parents[1] / "data" / "hermes_tools.jinja"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path: str) -> Tokenizer:
    return load_tokenizer(default_gguf_path)


def chat(tokenizer: TokenizerLike, fields: dict[str, Any]) -> Any:
    return parse_chat({"messages": HI, **fields}, tokenizer, 1024)


def refusal(call: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as info:
        call(*args)
    assert info.value.status == 400
    return info.value


CONSTRAINTS = [
    (
        {"response_format": {"type": "json_object"}},
        Constraint("json_object", "", "response_format"),
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": SCHEMA},
            }
        },
        Constraint("json_schema", json.dumps(SCHEMA), "response_format"),
    ),
    ({"grammar": 'root ::= "a"'}, Constraint("gbnf", 'root ::= "a"', "grammar")),
    ({"json_schema": SCHEMA}, Constraint("json_schema", json.dumps(SCHEMA), "json_schema")),
    ({"guided_json": SCHEMA}, Constraint("json_schema", json.dumps(SCHEMA), "guided_json")),
    (
        {"guided_json": json.dumps(SCHEMA)},
        Constraint("json_schema", json.dumps(SCHEMA), "guided_json"),
    ),
    ({"guided_regex": "[0-9]+"}, Constraint("regex", "[0-9]+", "guided_regex")),
    ({"guided_choice": ["a", "b"]}, Constraint("choice", '["a", "b"]', "guided_choice")),
    ({"guided_grammar": 'root ::= "a"'}, Constraint("gbnf", 'root ::= "a"', "guided_grammar")),
]


@pytest.mark.parametrize(("fields", "expected"), CONSTRAINTS, ids=lambda v: str(v)[:30])
def test_every_structured_output_spelling_is_one_constraint(
    tokenizer: Tokenizer, fields: dict[str, Any], expected: Constraint
) -> None:
    assert chat(tokenizer, fields).params[0].constraint == expected
    completion = parse_completion({"prompt": "Hi", **fields}, tokenizer, 1024)
    assert completion.params[0].constraint == expected


def test_text_format_is_no_constraint_and_two_constraints_are_a_400(tokenizer: Tokenizer) -> None:
    assert chat(tokenizer, {"response_format": {"type": "text"}}).params[0].constraint is None
    error = refusal(chat, tokenizer, {"grammar": 'root ::= "a"', "guided_choice": ["a"]})
    assert error.param == "guided_choice"
    assert refusal(chat, tokenizer, {"guided_json": "{not json"}).param == "guided_json"
    missing = {"response_format": {"type": "json_schema"}}
    assert refusal(chat, tokenizer, missing).param == "response_format"


def test_the_extensions_reach_the_params(tokenizer: Tokenizer) -> None:
    fields = {"logit_bias": {"17": -5, "3": 2.5}, "min_tokens": 4, "repetition_penalty": 1.3}
    params = chat(tokenizer, fields).params[0]
    assert params.logit_bias == ((3, 2.5), (17, -5.0))
    assert (params.min_tokens, params.repetition_penalty) == (4, 1.3)
    assert refusal(chat, tokenizer, {"logit_bias": {"x1": 1}}).param == "logit_bias"


class Recording:
    """The real tokenizer, noting the conversations it is asked to render."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.rendered: list[list[dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def apply_chat_template(self, messages: list[dict[str, Any]], *args: Any, **kw: Any) -> str:
        self.rendered.append(messages)
        return self.tokenizer.apply_chat_template(messages, *args, **kw)


def test_tool_turns_keep_their_fields_for_a_template_with_tool_syntax(tokenizer: Tokenizer) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "42"},
    ]
    recording = Recording(tokenizer)
    recording.chat_template = HERMES.read_text()  # a template that renders tools itself
    parse_chat({"messages": messages}, recording, 1024)  # type: ignore[arg-type]
    seen = recording.rendered
    # null content is empty text: templates read message.content whether or not there are calls
    assert seen[0][1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert seen[0][2] == {"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "42"}


def test_a_tool_loops_last_turn_without_tools_keeps_its_history(tokenizer: Tokenizer) -> None:
    """The default template has no tool syntax: the earlier call and its result are rendered in the
    generic format the model saw them in, even when the last request sends no tools."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "42"},
    ]
    recording = Recording(tokenizer)
    parse_chat({"messages": messages}, recording, 1024)  # type: ignore[arg-type]
    rendered = recording.rendered[0]
    assert rendered[1]["role"] == "assistant" and '"name":"f"' in rendered[1]["content"].replace(
        " ", ""
    )
    assert rendered[2] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


def test_echo_keeps_each_prompts_text(tokenizer: Tokenizer) -> None:
    texts = parse_completion({"prompt": ["a b", "c"], "echo": True}, tokenizer, 1024).echo
    assert texts == ["a b", "c"]
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    by_ids = parse_completion({"prompt": ids, "echo": True}, tokenizer, 1024)
    assert by_ids.echo == ["hello there"]
    assert parse_completion({"prompt": "a"}, tokenizer, 1024).echo is None


REFUSED_CHATS = [
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": "Hi", "extra": 1}]}, "messages"),
    ({"n": 2, "best_of": 3}, "best_of"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED_CHATS, ids=lambda v: str(v)[:30])
def test_chat_refusals_name_the_field(
    tokenizer: Tokenizer, fields: dict[str, Any], param: str
) -> None:
    assert refusal(chat, tokenizer, fields).param == param


def test_suffix_needs_fim_tokens_the_default_model_lacks(tokenizer: Tokenizer) -> None:
    error = refusal(parse_completion, {"prompt": "def f(", "suffix": "):"}, tokenizer, 1024)
    assert error.param == "suffix" and "fill-in-the-middle" in error.message
