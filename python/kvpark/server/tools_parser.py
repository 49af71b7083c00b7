"""One choice's streamed text -> content and tool calls (``<tool_call>`` JSON blocks).

A block is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (whitespace around the JSON
allowed). Text that may be the start of ``<tool_call>`` is held back until it is known not to be, so
no tag fragment leaks into the content. When a block opens with ``{"name": "...", "arguments": {``
(the order the grammar and the Hermes-style templates produce) the first piece (id, name) goes
out at once and its arguments stream as fragments, scanned for the object's end; any other block is
held until ``</tool_call>`` and parsed whole: a valid ``{"name": str, "arguments": object}`` is a
call, anything else (malformed JSON, a missing name) comes out unchanged as text, tags included.
Whitespace next to a call is dropped; whitespace-only text with no call comes out at the end.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
# the start of a block whose arguments can stream: name first, then an arguments object
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


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


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _ObjectScanner:
    """Finds where a JSON object ends in text that arrives piece by piece."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def end(self, text: str) -> int | None:
        """The index just past the object's closing brace in ``text``, or None if not there yet."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class ToolCallParser:
    """Splits one choice's streamed text into content and tool calls.

    ``parse=False`` (tool_choice ``none``) passes every piece through as text."""

    def __init__(self, parse: bool = True) -> None:
        self.parse = parse
        self._calls: list[ToolCall] = []
        self._content: list[str] = []
        self._buffer = ""  # text not yet decided on
        self._in_block = False  # inside <tool_call> ... </tool_call>
        self._streaming: _ObjectScanner | None = None  # a call's arguments are streaming
        self._args_done = False  # the streaming call's arguments ended; skip to </tool_call>
        self._whitespace = ""  # held whitespace: content unless a call comes next to it
        self._args: list[str] = []
        self._pending = ToolCall("", "", "")  # the streaming call's id and name
        self._held_before = ""  # the whitespace held when a block opened
        self._after_call = False  # the last thing out was a call: its trailing whitespace drops

    # -- in -------------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Delta]:
        if not self.parse:
            return self._emit(text) if text else []
        self._buffer += text
        out: list[Delta] = []
        while True:
            before = len(out), self._buffer, self._in_block
            if not self._in_block:
                self._step_text(out)
            elif self._streaming is not None:
                self._step_arguments(out)
            else:
                self._step_block(out)
            if (len(out), self._buffer, self._in_block) == before:
                return out

    def finish(self) -> list[Delta]:
        """What is held back at the end of the choice (an unterminated call comes out as text)."""
        out: list[Delta] = []
        if self._in_block and self._streaming is not None:
            # a streamed call cut short (max_tokens): it stands with the arguments it got
            if not self._args_done and self._buffer:
                out.append(self._arg_piece(self._buffer))
            self._close_streamed()
        elif self._in_block:
            self._whitespace = self._held_before
            out.extend(self._text(OPEN + self._buffer))
        else:
            out.extend(self._text(self._buffer))
        self._buffer = ""
        self._in_block = False
        if self._whitespace and not self._calls:
            out.extend(self._emit(self._whitespace))
        self._whitespace = ""
        return out

    # -- out ------------------------------------------------------------------------------------

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    @property
    def content(self) -> str:
        """The choice's text outside any call."""
        return "".join(self._content)

    # -- steps ----------------------------------------------------------------------------------

    def _step_text(self, out: list[Delta]) -> None:
        at = self._buffer.find(OPEN)
        if at >= 0:
            out.extend(self._text(self._buffer[:at]))
            # whitespace just before a call is dropped, unless the block turns out to be text
            self._held_before, self._whitespace = self._whitespace, ""
            self._buffer = self._buffer[at + len(OPEN) :]
            self._in_block = True
            return
        keep = _partial_suffix(self._buffer, OPEN)
        ready, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[-keep:]
        if not keep:
            self._buffer = ""
        out.extend(self._text(ready))

    def _step_block(self, out: list[Delta]) -> None:
        header = _HEADER.match(self._buffer)
        if header is not None:
            name = json.loads(header.group(1))
            self._pending = ToolCall(new_call_id(), name, "")
            out.append(ToolCallDelta(len(self._calls), self._pending.id, name, ""))
            self._streaming = _ObjectScanner()
            self._args_done = False
            self._args = []
            self._buffer = self._buffer[header.end() :]
            return
        at = self._buffer.find(CLOSE)
        if at < 0:
            return
        block, self._buffer = self._buffer[:at], self._buffer[at + len(CLOSE) :]
        self._in_block = False
        call = _whole_call(block)
        if call is None:  # not a call after all: the block as it was written
            self._whitespace = self._held_before
            out.extend(self._text(OPEN + block + CLOSE))
            return
        index = len(self._calls)
        self._calls.append(call)
        self._whitespace = ""
        self._after_call = True
        out.append(ToolCallDelta(index, call.id, call.name, ""))
        out.append(ToolCallDelta(index, None, None, call.arguments))

    def _step_arguments(self, out: list[Delta]) -> None:
        if not self._args_done:
            scanner = self._streaming
            assert scanner is not None
            end = scanner.end(self._buffer)
            if end is None:
                if self._buffer:
                    out.append(self._arg_piece(self._buffer))
                self._buffer = ""
                return
            out.append(self._arg_piece(self._buffer[:end]))
            self._buffer = self._buffer[end:]
            self._args_done = True
        # what follows the arguments up to </tool_call> (the outer brace, whitespace) is dropped
        at = self._buffer.find(CLOSE)
        if at < 0:
            keep = _partial_suffix(self._buffer, CLOSE)
            self._buffer = self._buffer[-keep:] if keep else ""
            return
        self._buffer = self._buffer[at + len(CLOSE) :]
        self._close_streamed()
        self._in_block = False

    # -- helpers --------------------------------------------------------------------------------

    def _arg_piece(self, text: str) -> ToolCallDelta:
        self._args.append(text)
        return ToolCallDelta(len(self._calls), None, None, text)

    def _close_streamed(self) -> None:
        call = self._pending
        self._calls.append(ToolCall(call.id, call.name, "".join(self._args)))
        self._streaming = None
        self._args_done = False
        self._whitespace = ""
        self._after_call = True

    def _text(self, text: str) -> list[Delta]:
        """Content. Trailing whitespace is held until more text follows it (a call next: dropped),
        so the content is the same however the text was cut into pieces."""
        body = text.rstrip()
        if self._after_call:
            body = body.lstrip()  # the layout after a call belongs to the call
        if not body:
            self._whitespace += text if not self._after_call else ""
            return []
        held, self._whitespace = self._whitespace, text[len(text.rstrip()) :]
        if self._after_call:
            held = ""
            self._after_call = False
        return self._emit(held + body)

    def _emit(self, text: str) -> list[Delta]:
        self._content.append(text)
        return [TextDelta(text)]


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _whole_call(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # already JSON text, as some models write it
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(arguments, ensure_ascii=False))
