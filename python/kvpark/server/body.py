"""A request body: read within a size limit, parsed as a JSON object, read field by field.

The size limit is checked twice: against Content-Length before reading, and by counting bytes while
reading (a chunked upload has no Content-Length). Past it the answer is 413 and the rest is not
read. JSON nested deeper than Python's parser recurses, and a string holding a lone UTF-16
surrogate (``"\\ud800"`` is valid JSON, but no UTF-8 text: the tokenizer would fail on it later,
outside the 400 path), are 400s that name the problem, and the latter its field. A large body is
parsed off the event loop (server/body_thread.py), so it does not stall the streams running.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from starlette.requests import ClientDisconnect, Request

from kvpark.server.body_thread import ON_LOOP_BYTES, PIECE, parse_off_loop, release
from kvpark.server.errors import APIError, bad_request


async def read_json(request: Request, limit: int) -> dict[str, object]:
    """The body as a JSON object; 413 past ``limit`` bytes (Content-Length or count), else 400."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("Content-Length is not a number")
        if int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes is over the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # nobody will read the answer; nothing to log
        raise bad_request("the client went away while sending its body") from None
    raw = b"".join(chunks)
    if len(raw) <= ON_LOOP_BYTES:
        return parse_json(raw, json.loads)
    return await parse_off_loop(raw, parse_json)


def parse_json(raw: bytes, loads: Callable[[bytes], object]) -> dict[str, object]:
    """``raw`` as a JSON object with no lone surrogate, parsed by ``loads``; else a 400."""
    try:
        body = loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise bad_request("the JSON body is nested too deeply") from None
    if not isinstance(body, dict):
        release(body)
        raise bad_request("the body must be a JSON object")
    where = lone_surrogate_at(body)
    if where is not None:
        # freed here, in slices: the error's traceback would keep the body alive until the event
        # loop dropped it, and freeing a million objects at once holds the GIL a while
        release(body)
        raise bad_request(f"{where} holds a lone UTF-16 surrogate, which is not text", where)
    return body


# json pairs a valid surrogate pair into one character, so any surrogate left is a lone one
_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(text: str) -> bool:
    """A piece at a time: one search of an 8 MiB prompt would hold the GIL ~35 ms."""
    if text.isascii():  # a flag of the string: no search at all
        return False
    return any(_SURROGATE.search(text, i, i + PIECE) for i in range(0, len(text), PIECE))


def lone_surrogate_at(value: object) -> str | None:
    """The path (``messages[0].content``) of the first string, key or value, in ``value`` that
    holds a lone surrogate, or None; iterative, so a deep body cannot recurse. Strings are checked
    where they stand and only containers wait on the stack: a million tuples of (string, path)
    would each be tracked by the garbage collector, whose full passes over them hold the GIL."""
    if isinstance(value, str):
        return "the body" if _has_surrogate(value) else None
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                if _has_surrogate(str(key)):
                    return f"{path}.{key}" if path else str(key)
                if isinstance(inner, str):
                    if _has_surrogate(inner):
                        return f"{path}.{key}" if path else str(key)
                elif isinstance(inner, dict | list):
                    stack.append((inner, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            for i, inner in enumerate(item):
                if isinstance(inner, str):
                    if _has_surrogate(inner):
                        return f"{path}[{i}]"
                elif isinstance(inner, dict | list):
                    stack.append((inner, f"{path}[{i}]"))
    return None


class Fields:
    """Typed getters over a JSON object; a wrong type is a 400 that names the field."""

    def __init__(self, body: dict[str, object]) -> None:
        self.body = body

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def integer(self, name: str) -> int | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{name} must be an integer", name)
        return value

    def number(self, name: str, default: float) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request(f"{name} must be a number", name)
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"{name} must be a boolean", name)
        return value

    def string(self, name: str) -> str | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise bad_request(f"{name} must be a string", name)
        return value

    def strings(self, name: str) -> tuple[str, ...]:
        value = self.body.get(name)
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return tuple(value)
        raise bad_request(f"{name} must be a string or a list of strings", name)

    def object(self, name: str) -> dict[str, object]:
        value = self.body.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise bad_request(f"{name} must be an object", name)
        return value
