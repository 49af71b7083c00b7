"""The generic tool format (a template without tool syntax) and the grammars of tool_choice.

Generic format: the tools and the ``<tool_call>`` convention are described in the system turn
(merged into the conversation's system message or a new first one); earlier assistant
``tool_calls`` become ``<tool_call>`` blocks in the assistant's text, and ``role: tool`` results a
user turn of ``<tool_response>`` blocks, which any template accepts (some refuse unknown roles or
two assistant turns in a row, none refuses a user turn after an assistant one).

Grammars are in llguidance's Lark dialect; each call's JSON is a ``%json`` schema fixing the name
and the arguments' ``parameters`` schema, so a constrained call always parses and validates.
"""

from __future__ import annotations

import json
from typing import Any

from kvpark.server.tools_parser import CLOSE, OPEN

JSON = dict[str, Any]
ANY_OBJECT: JSON = {"type": "object"}
# JSON laid out as one line, as the grammar helper's structured outputs are: a small model given
# free whitespace fills a call with newlines and indents
COMPACT: JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def describe_tools(tools: list[JSON], choice: str, forced: str | None) -> str:
    """The system-turn text that tells a model without tool syntax how to call the tools."""
    lines = [
        "You have access to these tools (JSON signatures):",
        "<tools>",
        *(json.dumps(t["function"], ensure_ascii=False) for t in tools),
        "</tools>",
        "To call a tool, reply with one block per call, exactly in this form:",
        f'{OPEN}\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}',
    ]
    if choice == "function":
        lines.append(f"You must call the tool {forced}.")
    elif choice == "required":
        lines.append("You must call at least one tool.")
    else:
        lines.append("If no tool is needed, reply with plain text instead.")
    return "\n".join(lines)


def generic_messages(messages: list[JSON], description: str | None) -> list[JSON]:
    """The conversation in the generic format's shape (``description``: None leaves tools out)."""
    out: list[JSON] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(call) for call in message["tool_calls"]]
            text = _text(message.get("content"))
            rest = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append({**rest, "content": "\n".join([text, *blocks] if text else blocks)})
        elif role == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block  # parallel results: one turn
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(dict(message))
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if description is None:
        return out
    if out and out[0].get("role") in ("system", "developer"):
        first = out[0]
        text = _text(first.get("content"))
        out[0] = {**first, "content": f"{text}\n\n{description}" if text else description}
    else:
        out.insert(0, {"role": "system", "content": description})
    return out


def calls_grammar(tools: list[JSON], parallel: bool, text_allowed: bool) -> str:
    """A Lark grammar: one call (or several with ``parallel``) to the given tools, or with
    ``text_allowed`` plain text instead (text that does not open with ``<``)."""
    rules = []
    names = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                "arguments": function.get("parameters") or ANY_OBJECT,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": COMPACT,
        }
        rules.append(f"call_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        names.append(f"call_{i}")
    call = f"call: {json.dumps(OPEN + chr(10))} ({' | '.join(names)}) {json.dumps(chr(10) + CLOSE)}"
    calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
    start = "start: calls | TEXT" if text_allowed else "start: calls"
    lines = [start, calls, call, *rules]
    if text_allowed:
        lines.append(r"TEXT: /[^<\s](.|\n)*/")
    return "\n".join(lines) + "\n"


def _call_block(call: object) -> str:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = arguments  # kept as the client wrote it
    body = {"name": function.get("name"), "arguments": parsed}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def _text(content: object) -> str:
    """A message's content as text: a string, None or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""
