"""Parser deltas -> the OpenAI chat shapes: ``delta.tool_calls`` pieces and ``message.tool_calls``.

A stream's pieces are what the ``openai`` client's stream helpers assemble: a call's first piece
carries ``index``, ``id``, ``type`` and ``function.name``; later ones only ``index`` and an
``function.arguments`` fragment, which the client appends. Fragments of one call that arrive in one
engine event are merged into one piece.
"""

from __future__ import annotations

from kvpark.server.tools_parser import Delta, TextDelta, ToolCall, ToolCallDelta

JSON = dict[str, object]


def chat_delta(deltas: list[Delta]) -> JSON:
    """The ``delta`` fields for one chunk's parser output (``content`` and/or ``tool_calls``)."""
    text = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    merged: list[ToolCallDelta] = []
    for d in deltas:
        if not isinstance(d, ToolCallDelta):
            continue
        if d.id is None and merged and merged[-1].index == d.index:
            last = merged[-1]
            merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + d.arguments)
        else:
            merged.append(d)
    delta: JSON = {}
    if text:
        delta["content"] = text
    if merged:
        delta["tool_calls"] = [_piece(d) for d in merged]
    return delta


def _piece(d: ToolCallDelta) -> JSON:
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    function = {"name": d.name, "arguments": d.arguments}
    return {"index": d.index, "id": d.id, "type": "function", "function": function}


def message_tool_calls(calls: list[ToolCall]) -> list[JSON]:
    return [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]


def finish_reason(reason: str, calls: list[ToolCall]) -> str:
    """``tool_calls`` for a choice that made calls and stopped on its own."""
    return "tool_calls" if calls and reason == "stop" else reason
