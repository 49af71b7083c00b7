"""SSE events as a client's decoder sees them: one per blank line, with its ``id:``, ``event:``,
``data:`` and the comment lines that rode with it (docs/server.md, "Reattachable streams"). Pings
(``:`` and ``: preempt-keepalive``) are the connection's, not the stream's: left out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

PINGS = {"", "preempt-keepalive"}


@dataclass
class Event:
    id: int | None = None
    type: str | None = None
    data: str = ""
    comments: list[str] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.data) if self.data and self.data != "[DONE]" else None


def events(source: httpx.Response | Iterator[str], stop_after: int | None = None) -> list[Event]:
    """The events of an SSE body; with ``stop_after``, only until that many have come. Pass the
    body's line iterator (``response.iter_lines()``, kept) to read on later: a line generator
    that is dropped closes the connection when it is collected."""
    lines = source.iter_lines() if isinstance(source, httpx.Response) else source
    out: list[Event] = []
    current = Event()
    for line in lines:
        if line == "":
            if current.id is not None or current.data or current.comments:
                out.append(current)
                if stop_after is not None and len(out) >= stop_after:
                    return out
            current = Event()
        elif line.startswith(":"):
            comment = line[1:].strip()
            if comment not in PINGS:
                current.comments.append(comment)
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "id":
                current.id = int(value)
            elif name == "event":
                current.type = value
            elif name == "data":
                current.data = value
    return out


def text_of(route: str, stream: list[Event]) -> str:
    """The generated text of a stream of ``route`` (completions, chat, responses, messages)."""
    parts = []
    for event in stream:
        obj = event.json()
        if obj is None:
            continue
        if route == "completions":
            parts += [c["text"] for c in obj["choices"]]
        elif route == "chat":
            parts += [c["delta"].get("content") or "" for c in obj["choices"]]
        elif route == "responses" and obj["type"] == "response.output_text.delta":
            parts.append(obj["delta"])
        elif route == "messages" and obj["type"] == "content_block_delta":
            parts.append(obj["delta"]["text"])
    return "".join(parts)


def notices(stream: list[Event]) -> list[str]:
    """The park notices of a stream, in order."""
    kinds = ("preempted", "resumed", "recomputed")
    return [c for e in stream for c in e.comments if c.split(" ")[0] in kinds]
