"""The benchmark's streaming HTTP client (``kvpark.bench.sse_http``) against servers that write
exact bytes: every body framing, lines split across chunks and reads, error statuses, and
responses it must refuse. (The OpenAI-shaped client above it is tested against a real Starlette
server in test_bench.py and against kvpark itself.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from kvpark.bench.sse_http import ConnectError, HttpStatusError, ProtocolError, post_lines

Reply = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def _serve_once(reply: Reply, seen: list[bytes]) -> tuple[asyncio.Server, str]:
    """A server that reads one request (head and JSON body), keeps it in ``seen`` and answers
    with ``reply``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        seen.append(head + await reader.readexactly(length))
        await reply(writer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/chat/completions?x=1"


def _lines(reply: Reply) -> tuple[list[str], list[bytes]]:
    async def go() -> tuple[list[str], list[bytes]]:
        seen: list[bytes] = []
        server, url = await _serve_once(reply, seen)
        async with server:
            got = [line async for line in post_lines(url, {"a": "é"}, {"X-Key": "k"})]
        return got, seen

    return asyncio.run(go())


def _write(*parts: bytes, pause: float = 0.01) -> Reply:
    async def reply(writer: asyncio.StreamWriter) -> None:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause)

    return reply


def test_chunked_lines_come_whole_across_chunk_and_read_boundaries() -> None:
    events = 'data: {"t": "é"}\r\n\r\n: preempted\n\ndata: [DONE]\n\n'.encode()
    # cut inside the two-byte é and between a CR and its LF
    cuts = [events[:14], events[14:18], events[18:20], events[20:]]
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in cuts) + b"0\r\nTrailer: x\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    got, seen = _lines(_write(head, body[:7], body[7:40], body[40:]))
    assert got == ['data: {"t": "é"}', "", ": preempted", "", "data: [DONE]", ""]
    request = seen[0]
    assert request.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
    assert b"\r\nX-Key: k\r\n" in request and b"\r\nConnection: close\r\n" in request
    assert json.loads(request.split(b"\r\n\r\n", 1)[1]) == {"a": "é"}


def test_sized_and_close_delimited_bodies() -> None:
    sized = _write(b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n", b"data: 1\ndata:", b" 2")
    assert _lines(sized)[0] == ["data: 1", "data: 2"]
    closed = _write(b"HTTP/1.0 200 OK\r\n\r\n", b"data: 1\n", b"data: 2\n")
    assert _lines(closed)[0] == ["data: 1", "data: 2"]


def test_an_error_status_raises_with_its_body() -> None:
    body = b'{"error": {"message": "bad"}}'
    head = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body)
    with pytest.raises(HttpStatusError) as caught:
        _lines(_write(head, body))
    assert caught.value.status == 400 and json.loads(caught.value.body)["error"]["message"] == "bad"


@pytest.mark.parametrize(
    "reply",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",  # not HTTP
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # bad chunk size
        b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort",  # closed early
    ],
)
def test_a_broken_response_raises_a_protocol_error(reply: bytes) -> None:
    with pytest.raises(ProtocolError):
        _lines(_write(reply))


def test_a_chunk_cut_off_by_the_close_raises() -> None:
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n20\r\nonly ten b"
    with pytest.raises(asyncio.IncompleteReadError):
        _lines(_write(reply))


def test_refused_and_unsupported_urls_raise_connect_errors() -> None:
    async def first(url: str) -> list[str]:
        return [line async for line in post_lines(url, {}, {})]

    async def refused_url() -> str:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        return f"http://127.0.0.1:{port}/"

    with pytest.raises(ConnectError, match="cannot connect"):
        asyncio.run(first(asyncio.run(refused_url())))
    with pytest.raises(ConnectError, match="not an http"):
        asyncio.run(first("ftp://example/"))
