"""A parsed Anthropic Messages body -> an OpenAI chat-completions body.

The chat parser (:func:`kvpark.server.protocol.parse_chat`) then does the rest exactly as for
``/v1/chat/completions``: template, tools plan, sampling parameters and their ranges. The mapping:

- ``system`` -> a leading ``system`` message; text blocks are joined.
- an assistant turn's ``tool_use`` blocks -> its ``tool_calls`` (``input`` as JSON arguments);
  a user turn's ``tool_result`` blocks -> ``role: tool`` messages, before the turn's own text, in
  the order given (Anthropic puts results first). ``is_error`` prefixes the result with
  ``Error:`` so the model reads it as a failure. Several text blocks are joined with newlines.
- ``stop_sequences`` -> ``stop``; ``temperature``, ``top_p``, ``top_k``, ``max_tokens`` as named.
- ``output_config.format`` (a JSON schema) -> ``response_format`` ``json_schema``, strict.
- ``tools`` -> function tools (``input_schema`` is the parameters schema); ``tool_choice`` ``auto``
  / ``any`` / ``tool`` / ``none`` -> ``auto`` / ``required`` / the named function / ``none``, and
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``.
"""

from __future__ import annotations

import json
from typing import Any

from kvpark.server.messages_api_body import (
    Message,
    MessagesBody,
    TextBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)

ERROR_PREFIX = "Error: "
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_body(body: MessagesBody) -> dict[str, object]:
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text(body.system)})
    for message in body.messages:
        messages.extend(_turn(message))
    chat: dict[str, object] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_tokens,
        "stream": body.stream,
    }
    optional: dict[str, object | None] = {
        "stop": body.stop_sequences,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "cache_salt": body.cache_salt,
    }
    chat.update({k: v for k, v in optional.items() if v is not None})
    if body.tools is not None:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    **({} if tool.description is None else {"description": tool.description}),
                    "parameters": tool.input_schema,
                    **({} if tool.strict is None else {"strict": tool.strict}),
                },
            }
            for tool in body.tools
        ]
    if body.tool_choice is not None:
        chat.update(_tool_choice(body.tool_choice))
    if body.output_config is not None and body.output_config.format is not None:
        schema = {"name": "output", "schema": body.output_config.format.schema_, "strict": True}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return chat


def _tool_choice(choice: ToolChoice) -> dict[str, object]:
    out: dict[str, object] = {
        "tool_choice": (
            {"type": "function", "function": {"name": choice.name}}
            if choice.type == "tool"
            else TOOL_CHOICES[choice.type]
        )
    }
    if choice.disable_parallel_tool_use is not None:
        out["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return out


def _turn(message: Message) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: tool results, then the turn's text and calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            result = _text(block.content)
            content = ERROR_PREFIX + result if block.is_error else result
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        else:
            texts.append(block.text)
    if calls:
        out.append({"role": "assistant", "content": "".join(texts), "tool_calls": calls})
    elif texts or not out:  # a turn of tool results alone adds no empty user message
        out.append({"role": message.role, "content": "".join(texts)})
    return out


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)
