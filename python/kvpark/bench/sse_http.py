"""The benchmark's streaming requests over asyncio streams: one connection per request, a POST of
a JSON body, and the response's lines as they arrive.

Why not httpx here: the benchmark runs its client on the same two cores as the server it
measures, so the client's cost per streamed chunk comes out of the server's figures, and more
out of the faster one's. Through httpx a chunk cost the client 130-160 µs of CPU (2-core Sapphire
Rapids VM); eight chats of a kvpark server streaming ~460 chunks a second then lost about a tenth
of their throughput to it (8.9 s against 8.1 s for the same 4,128 chunks, alternated). Read here,
a chunk costs about 20 µs. Every other request of the benchmark (``/v1/models``, ``/metrics``,
the soak's probes) keeps httpx: they are few.

HTTP/1.1 only, as every server the benchmark drives speaks it: chunked, sized or
close-delimited bodies; ``https`` URLs through the default TLS context. A status other than 200
raises :class:`HttpStatusError` with the body; a refused or failed connection
:class:`ConnectError`.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

# a status line or header longer than this is not from a server under test
_MAX_HEAD_LINE = 64 * 1024


class HttpStatusError(Exception):
    """The server answered with a status other than 200."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class ConnectError(Exception):
    """No connection to the server (refused, unreachable, TLS failed)."""


class ProtocolError(Exception):
    """The server's bytes are not an HTTP/1.1 response this client can read."""


async def post_lines(
    url: str, body: Mapping[str, Any], headers: Mapping[str, str]
) -> AsyncGenerator[str, None]:
    """POSTs ``body`` as JSON to ``url`` and yields the response's lines (without their line
    ends) as they arrive. The connection is closed when the iteration ends, however it ends."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConnectError(f"not an http(s) URL: {url!r}")
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    try:
        reader, writer = await asyncio.open_connection(
            parts.hostname, port, ssl=ssl.create_default_context() if secure else None
        )
    except OSError as exc:  # refused, unreachable, TLS (ssl.SSLError is an OSError)
        raise ConnectError(f"cannot connect to {parts.hostname}:{port}: {exc}") from exc
    try:
        payload = json.dumps(body).encode()
        head = [
            f"POST {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1",
            f"Host: {parts.netloc}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            f"Content-Length: {len(payload)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in headers.items()),
        ]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
        await writer.drain()
        status, fields = await _read_head(reader)
        chunks = _body(reader, fields)
        if status != 200:
            text = b"".join([c async for c in chunks]).decode(errors="replace")
            raise HttpStatusError(status, text)
        pending = b""
        async for data in chunks:
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode(errors="replace")
        if pending:
            yield pending.rstrip(b"\r").decode(errors="replace")
    finally:
        writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the header fields (names lower-cased) of the response."""
    status_line = await _line(reader)
    version, _, rest = status_line.partition(" ")
    code = rest.split(" ", 1)[0]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:100]!r}")
    fields: dict[str, str] = {}
    while line := await _line(reader):
        name, sep, value = line.partition(":")
        if not sep:
            raise ProtocolError(f"malformed header line: {line[:100]!r}")
        fields[name.strip().lower()] = value.strip()
    return int(code), fields


async def _line(reader: asyncio.StreamReader) -> str:
    line = await reader.readline()
    if len(line) > _MAX_HEAD_LINE or (line and not line.endswith(b"\n")):
        raise ProtocolError("response head line too long or cut off")
    return line.rstrip(b"\r\n").decode("latin-1")


async def _body(reader: asyncio.StreamReader, fields: Mapping[str, str]) -> AsyncIterator[bytes]:
    """The response body's bytes as they arrive, by its framing."""
    if "chunked" in fields.get("transfer-encoding", "").lower():
        while True:
            size_line = await _line(reader)
            try:
                size = int(size_line.split(";", 1)[0].strip(), 16)
            except ValueError as exc:
                raise ProtocolError(f"bad chunk size line: {size_line[:100]!r}") from exc
            if size == 0:
                while await _line(reader):  # trailer fields, then the blank line
                    pass
                return
            data = await reader.readexactly(size)
            if await reader.readline() not in (b"\r\n", b"\n"):
                raise ProtocolError("a chunk did not end in CRLF")
            yield data
    elif "content-length" in fields:
        left = int(fields["content-length"])
        while left > 0:
            data = await reader.read(min(left, 1 << 16))
            if not data:
                raise ProtocolError(f"the body ended {left} bytes short")
            left -= len(data)
            yield data
    else:  # delimited by the connection's close
        while data := await reader.read(1 << 16):
            yield data
