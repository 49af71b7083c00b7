"""Tool calling: tools into the prompt, tool_choice into a grammar, the output back into calls.

INTERFACE STUB (the issue-14 contract; the implementation replaces the bodies below).

Two formats: the chat template's own when it renders ``tools`` (Hermes-style ``<tool_call>`` JSON,
as the Qwen2.5/Qwen3 templates use), and a generic one for a template without tool syntax (the
default model's): the tools are described in the system turn and the reply is constrained to a
call or text. ``required`` and a named function are enforced with the grammar.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpark.sampling.params import Constraint


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_..."
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a call: ``id`` and ``name`` on its first piece, then argument text."""

    index: int  # which call of this choice, from 0
    id: str | None
    name: str | None
    arguments: str  # a fragment of the arguments' JSON text (may be "")


Delta = TextDelta | ToolCallDelta


class ToolCallParser:
    """Splits one choice's streamed text into content and tool calls."""

    def feed(self, text: str) -> list[Delta]:
        raise NotImplementedError

    def finish(self) -> list[Delta]:
        """What is held back at the end of the choice (an unterminated call comes out as text)."""
        raise NotImplementedError

    @property
    def calls(self) -> list[ToolCall]:
        raise NotImplementedError

    @property
    def content(self) -> str:
        """The choice's text outside any call."""
        raise NotImplementedError


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools do to its prompt, its sampling and its output."""

    messages: list[dict[str, Any]]  # the conversation to render (tool turns in the format's shape)
    template_tools: list[dict[str, Any]] | None  # ``tools=`` for the chat template; None: generic
    constraint: Constraint | None  # the grammar for required / a named function / generic auto
    choice: str  # "none", "auto", "required" or "function"

    def parser(self) -> ToolCallParser:
        raise NotImplementedError


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
    raise NotImplementedError
