"""Tool calling: tools into the prompt, tool_choice into a grammar, the output back into calls.

Two formats (docs/tool-calls.md): the chat template's own when it renders ``tools`` (Hermes-style
``<tool_call>`` JSON, as the Qwen2.5/Qwen3 templates use; the template renders earlier calls and
``role: tool`` results itself), and a generic one for a template without tool syntax (the default
model's): the tools are described in the system turn and the reply is constrained to a call or
text (``tools_format.py``). ``required`` and a named function are enforced with a grammar in both.
``tool_choice: none`` leaves the tools out of the prompt (as vLLM does) and parses nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvpark.sampling.params import Constraint
from kvpark.server.errors import bad_request
from kvpark.server.tools_format import calls_grammar, describe_tools, generic_messages
from kvpark.server.tools_parser import Delta, TextDelta, ToolCall, ToolCallDelta, ToolCallParser

__all__ = [
    "Delta",
    "TextDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolPlan",
    "plan_tools",
    "template_has_tools",
]

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
# a template that mentions the variable ``tools`` renders them (and tool turns) itself
_TOOLS_VAR = re.compile(r"\btools\b")


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools do to its prompt, its sampling and its output."""

    messages: list[dict[str, Any]]  # the conversation to render (tool turns in the format's shape)
    template_tools: list[dict[str, Any]] | None  # ``tools=`` for the chat template; None: generic
    constraint: Constraint | None  # the grammar for required / a named function / generic auto
    choice: str  # "none", "auto", "required" or "function"

    def parser(self) -> ToolCallParser:
        """A fresh parser for one choice (``none``: every piece is text)."""
        return ToolCallParser(parse=self.choice != "none")


def template_has_tools(chat_template: str) -> bool:
    return _TOOLS_VAR.search(chat_template) is not None


def plan_tools(
    messages: list[dict[str, Any]],
    tools: object,
    tool_choice: object,
    parallel_tool_calls: object,
    chat_template: str,
) -> ToolPlan | None:
    """The plan for a chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (raw
    JSON values; None when not given); None when the request has no tools. A 400 (``APIError``)
    names a bad field. ``chat_template`` is the template's source, to tell the formats apart."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    _check_history(messages)
    if tools is None or tools == []:
        if tool_choice is not None and tool_choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        if parallel_tool_calls is not None:
            raise bad_request("parallel_tool_calls needs tools", "parallel_tool_calls")
        if not any(_has_tool_turn(m) for m in messages):
            return None
        checked: list[dict[str, Any]] = []  # a tool loop's last turn, sent without tools
    else:
        checked = _check_tools(tools)
    choice, forced = _check_choice(tool_choice, checked)
    parallel = parallel_tool_calls is not False  # OpenAI's default: true
    offered = [] if choice == "none" else checked
    if forced is not None:
        offered = [t for t in checked if t["function"]["name"] == forced]
    if template_has_tools(chat_template):
        constraint = None
        if choice in ("required", "function"):
            constraint = _grammar(offered, parallel and choice == "required", False)
        return ToolPlan(messages, checked if choice != "none" else None, constraint, choice)
    description = describe_tools(offered, choice, forced) if offered else None
    rendered = generic_messages(messages, description)
    constraint = None
    if offered:
        constraint = _grammar(offered, parallel and choice != "function", choice == "auto")
    return ToolPlan(rendered, None, constraint, choice)


def _grammar(tools: list[dict[str, Any]], parallel: bool, text_allowed: bool) -> Constraint:
    return Constraint("lark", calls_grammar(tools, parallel, text_allowed), param="tools")


def _check_tools(tools: object) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", "tools")
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                f'{where} must be {{"type": "function", "function": {{...}}}}', "tools"
            )
        if set(tool) - {"type", "function"}:
            raise bad_request(
                f"{where} has unknown keys {sorted(set(tool) - {'type', 'function'})}", "tools"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function must be an object", "tools")
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise bad_request(f"{where}.function has unknown keys {sorted(unknown)}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise bad_request(f"{where}.function.name must match {NAME.pattern}", "tools")
        if name in seen:
            raise bad_request(f"{where}: the function name {name!r} is given twice", "tools")
        seen.add(name)
        if not isinstance(function.get("description", ""), str):
            raise bad_request(f"{where}.function.description must be a string", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
        if not isinstance(function.get("strict", False), bool | None):
            raise bad_request(f"{where}.function.strict must be a boolean", "tools")
        out.append({"type": "function", "function": function})
    return out


def _check_choice(tool_choice: object, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(choice, the forced function's name)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise bad_request(
                f"tool_choice must be one of {list(CHOICES)} or a function", "tool_choice"
            )
        if tool_choice != "none" and not tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not name:
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return "function", name


def _has_tool_turn(message: dict[str, Any]) -> bool:
    return message.get("role") == "tool" or bool(message.get("tool_calls"))


def _check_history(messages: list[dict[str, Any]]) -> None:
    """Earlier calls and results must have the shape the formats render."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is not None:
            if message.get("role") != "assistant" or not isinstance(calls, list):
                raise bad_request(
                    f"messages[{i}].tool_calls: a list, on assistant messages", "messages"
                )
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if not (
                    isinstance(function, dict)
                    and isinstance(function.get("name"), str)
                    and isinstance(function.get("arguments"), str)
                ):
                    raise bad_request(
                        f"messages[{i}].tool_calls: each call needs function.name and "
                        "function.arguments (a JSON string)",
                        "messages",
                    )
