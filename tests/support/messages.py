"""Helpers for the ``/v1/messages`` tests: the real ``anthropic`` client on a local server, and a
raw SSE reader that keeps the event names and the comments the client hides."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx

from support.servers import Server

MAX_S = 300.0
# anthropic 2.x no longer takes temperature / top_p / top_k as arguments: they go as extra_body
GREEDY = {"temperature": 0}


def client(server: Server, api_key: str | None = None) -> anthropic.Anthropic:
    """The Anthropic client pointed at the server; it sends ``x-api-key``."""
    key = api_key if api_key is not None else (server.api_key or "unused")
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=MAX_S)


def ask(text: str, max_tokens: int = 24, **more: Any) -> dict[str, Any]:
    """A Messages body with one user turn."""
    return {
        "model": "default",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
        **more,
    }


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def post(
    server: Server, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    key = {"x-api-key": server.api_key} if server.api_key else {}
    return httpx.post(
        f"{server.base_url}/v1/messages", json=body, headers=headers or key, timeout=MAX_S
    )


def assert_anthropic_error(response: httpx.Response, status: int, kind: str, needle: str) -> None:
    """Anthropic's error shape, with the status and a message that says what was wrong."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == kind, body
    assert needle in body["error"]["message"], body


@dataclass
class RawStream:
    """One streamed request read with httpx: ``(event name, data)`` pairs and SSE comments."""

    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)

    @property
    def types(self) -> list[str]:
        return [name for name, _ in self.events]

    def text(self) -> str:
        return "".join(
            data["delta"]["text"]
            for name, data in self.events
            if name == "content_block_delta" and data["delta"]["type"] == "text_delta"
        )

    def last(self, name: str) -> dict[str, Any]:
        return [data for seen, data in self.events if seen == name][-1]


def raw_stream(server: Server, body: dict[str, Any]) -> RawStream:
    key = {"x-api-key": server.api_key} if server.api_key else {}
    out = RawStream()
    name = ""
    url = f"{server.base_url}/v1/messages"
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=key, timeout=MAX_S) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith(":"):
                out.comments.append(line)
            elif line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name, (name, data)  # the event line names the data
                out.events.append((name, data))
    return out
