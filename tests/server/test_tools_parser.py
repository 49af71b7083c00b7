"""The tool-call parser and the tool plan, without a server (plain text and JSON in, deltas out)."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from kvpark.server.errors import APIError
from kvpark.server.tools import (
    TextDelta,
    ToolCallDelta,
    ToolCallParser,
    plan_tools,
    template_has_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
HERMES = "{% if tools %}{{ tools | tojson }}{% endif %}"
USER = [{"role": "user", "content": "hi"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def run(text: str, pieces: int) -> tuple[list[TextDelta | ToolCallDelta], ToolCallParser]:
    """Feed ``text`` in pieces of ``pieces`` characters, as a stream would."""
    parser = ToolCallParser()
    out: list[TextDelta | ToolCallDelta] = []
    for i in range(0, len(text), pieces):
        out.extend(parser.feed(text[i : i + pieces]))
    out.extend(parser.finish())
    return out, parser


def assembled(deltas: list[TextDelta | ToolCallDelta]) -> tuple[str, list[dict[str, str]]]:
    """Content and calls put back together from deltas, as the openai client does."""
    text = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    calls: list[dict[str, str]] = []
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.index == len(calls):
                assert d.id is not None and d.id.startswith("call_") and d.name is not None
                calls.append({"name": d.name, "arguments": ""})
            calls[d.index]["arguments"] += d.arguments
    return text, calls


@pytest.mark.parametrize("pieces", [1, 2, 5, 1000])
def test_a_call_in_any_pieces(pieces: int) -> None:
    deltas, parser = run(CALL, pieces)
    text, calls = assembled(deltas)
    assert text == "" and parser.content == ""
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    if pieces < len(CALL):  # arguments stream as fragments, not in one piece at the end
        assert sum(1 for d in deltas if isinstance(d, ToolCallDelta) and d.arguments) > 1


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_text_then_two_calls(pieces: int) -> None:
    other = CALL.replace("Paris", 'Ro}me \\"x\\"')  # braces and escapes inside strings
    deltas, parser = run("Let me look. " + CALL + "\n" + other + "\n", pieces)
    text, calls = assembled(deltas)
    assert text == "Let me look." == parser.content  # whitespace next to a call dropped
    assert [json.loads(c["arguments"])["city"] for c in calls] == ["Paris", 'Ro}me "x"']
    assert [c.arguments for c in parser.calls] == [c["arguments"] for c in calls]


@pytest.mark.parametrize("pieces", [1, 4])
def test_no_tag_fragment_leaks(pieces: int) -> None:
    deltas, parser = run("a <tool b <tool_cal c < d", pieces)
    text, calls = assembled(deltas)
    assert text == "a <tool b <tool_cal c < d" and calls == []
    # while "<tool_ca" might still become a tag it is held back
    parser = ToolCallParser()
    assert parser.feed("x <tool_ca") == [TextDelta("x")]  # its space waits for what follows
    assert parser.finish() == [TextDelta(" <tool_ca")]


def test_malformed_block_is_text() -> None:
    block = "<tool_call>\n{not json}\n</tool_call>"
    deltas, parser = run("see " + block + " end", 3)
    assert assembled(deltas) == ("see " + block + " end", [])
    assert parser.calls == []


def test_other_key_order_parses_whole() -> None:
    block = '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'
    deltas, _ = run(block, 2)
    assert assembled(deltas) == ("", [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}])


def test_unterminated_block_is_text_and_cut_call_stands() -> None:
    deltas, _ = run('<tool_call>{"arguments": {', 2)
    assert assembled(deltas) == ('<tool_call>{"arguments": {', [])
    deltas, parser = run('<tool_call>{"name": "get_weather", "arguments": {"ci', 2)
    assert assembled(deltas) == ("", [{"name": "get_weather", "arguments": '{"ci'}])
    assert len(parser.calls) == 1


def test_whitespace_only_text_without_calls_survives() -> None:
    assert assembled(run("\n\n", 1)[0]) == ("\n\n", [])
    assert assembled(run("  hello", 1)[0]) == ("  hello", [])


def test_parse_off_passes_everything() -> None:
    parser = ToolCallParser(parse=False)
    assert parser.feed(CALL) == [TextDelta(CALL)]
    assert parser.finish() == [] and parser.calls == [] and parser.content == CALL


# -- the plan -------------------------------------------------------------------------------------


def lark_ok(source: str) -> None:
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(source))
    assert not error, error


def test_formats_told_apart() -> None:
    assert template_has_tools(HERMES) and not template_has_tools(PLAIN)
    hermes = plan_tools(USER, [WEATHER], None, None, HERMES)
    assert hermes is not None and hermes.template_tools == [WEATHER] and hermes.constraint is None
    assert hermes.messages == USER and hermes.choice == "auto"
    generic = plan_tools(USER, [WEATHER], None, None, PLAIN)
    assert generic is not None and generic.template_tools is None
    assert (
        generic.messages[0]["role"] == "system" and "get_weather" in generic.messages[0]["content"]
    )
    assert generic.constraint is not None and generic.constraint.kind == "lark"
    lark_ok(generic.constraint.source)
    assert "TEXT" in generic.constraint.source  # auto: a call or text


def test_generic_merges_into_system() -> None:
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    plan = plan_tools(messages, [WEATHER], "auto", None, PLAIN)
    assert plan is not None and len(plan.messages) == 2
    assert plan.messages[0]["content"].startswith("Be brief.\n\n")


@pytest.mark.parametrize("template", [PLAIN, HERMES])
def test_required_and_named_grammars(template: str) -> None:
    required = plan_tools(USER, [WEATHER, TIME], "required", None, template)
    assert required is not None and required.constraint is not None
    assert (
        "get_time" in required.constraint.source
        and 'call ("\\n" call)*' in required.constraint.source
    )
    lark_ok(required.constraint.source)
    single = plan_tools(USER, [WEATHER, TIME], "required", False, template)
    assert single is not None and single.constraint is not None
    assert "calls: call\n" in single.constraint.source
    named = {"type": "function", "function": {"name": "get_time"}}
    forced = plan_tools(USER, [WEATHER, TIME], named, True, template)
    assert forced is not None and forced.choice == "function" and forced.constraint is not None
    assert "get_weather" not in forced.constraint.source and "TEXT" not in forced.constraint.source
    lark_ok(forced.constraint.source)


def test_none_leaves_tools_out_and_parses_nothing() -> None:
    for template in (PLAIN, HERMES):
        plan = plan_tools(USER, [WEATHER], "none", None, template)
        assert plan is not None and plan.constraint is None and plan.template_tools is None
        assert plan.messages == USER
        assert plan.parser().feed(CALL) == [TextDelta(CALL)]


def test_generic_renders_history() -> None:
    history: list[dict[str, Any]] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "warm"},
    ]
    plan = plan_tools(history, [WEATHER], "auto", None, PLAIN)
    assert plan is not None
    roles = [m["role"] for m in plan.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert plan.messages[2]["content"] == CALL and "tool_calls" not in plan.messages[2]
    assert plan.messages[3]["content"] == (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"
    )
    # the loop's last request may drop tools: the history still needs the generic shape
    bare = plan_tools(history, None, None, None, PLAIN)
    assert bare is not None and bare.choice == "none" and bare.messages[1]["content"] == CALL
    assert plan_tools(USER, None, None, None, PLAIN) is None


BAD: list[tuple[object, object, object, str]] = [
    ({"type": "function"}, None, None, "tools"),  # not a list
    ([{"type": "retrieval"}], None, None, "tools"),
    ([{"type": "function", "function": {"name": "a b"}}], None, None, "tools"),
    ([{"type": "function", "function": {}}], None, None, "tools"),
    ([WEATHER, WEATHER], None, None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, None, "tools"),
    ([{"type": "function", "function": {"name": "f", "extra": 1}}], None, None, "tools"),
    ([WEATHER], "sometimes", None, "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
    ([WEATHER], {"type": "function"}, None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    (None, {"type": "function", "function": {"name": "get_weather"}}, None, "tool_choice"),
    ([WEATHER], None, "yes", "parallel_tool_calls"),
    (None, None, True, "parallel_tool_calls"),
]


@pytest.mark.parametrize(("tools", "choice", "parallel", "param"), BAD)
def test_bad_fields_are_400s_naming_them(
    tools: object, choice: object, parallel: object, param: str
) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(USER, tools, choice, parallel, PLAIN)
    assert info.value.status == 400 and info.value.param == param


def test_bad_history_is_a_400() -> None:
    bad = [*USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]
    with pytest.raises(APIError) as info:
        plan_tools(bad, [WEATHER], None, None, PLAIN)
    assert info.value.param == "messages"
