"""A client that stops reading a stream (docs/server.md, "Slow and stalled readers"): a raw socket
with a small receive buffer asks for a long stream and then reads nothing. Once the server's writes
wait ``--stall-timeout`` seconds the stream is aborted: a log line names it, its cells and parked
bytes come back, the connection closes, and a request running beside it meanwhile completes with
the same text it has alone.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from support.servers import Server, serve_for_module

STALL_S = 2.0
LONG = 1500  # tokens: far more than the socket and the transport buffer hold as SSE chunks
CHECK = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # the smallest send buffer, so the stall shows after a few hundred tokens, not a thousand
    yield from serve_for_module("--stall-timeout", str(STALL_S), "--send-buffer", "4096")


def stalled_stream(server: Server) -> socket.socket:
    """A streamed completion asked for over a socket that will not be read."""
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect((host, int(port)))
    body = json.dumps(
        {"prompt": "Once upon a time", "max_tokens": LONG, "stream": True, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def generated(server: Server) -> float:
    return float(server.metric("kvpark_generation_tokens_total"))


def test_stalled_stream_is_aborted_and_gives_its_cells_back(server: Server) -> None:
    with server.client() as http:
        alone = http.post("/v1/completions", json=CHECK).json()["choices"][0]["text"]
    idle_cells = server.metric("kvpark_kv_cells_used")
    before = generated(server)
    sock = stalled_stream(server)
    try:
        started = time.monotonic()
        with server.client() as http:  # beside the stalled one, as it fills its buffers
            beside = http.post("/v1/completions", json=CHECK).json()["choices"][0]["text"]
        assert beside == alone
        text = server.wait_for_log("(--stall-timeout)", timeout=120.0)
        aborted_after = time.monotonic() - started
        assert "aborted: the client read nothing for 2 s" in text
        server.wait_cells_free(timeout=10.0)
        assert server.metric("kvpark_kv_cells_used") == idle_cells == 0
        assert server.metric("kvpark_preempt_ram_bytes") == 0
        made = generated(server) - before
        # it stopped well short of LONG: not generated to the end into a buffer
        assert made < LONG, (made, aborted_after)
        # and the engine is no longer feeding it: the count stands still
        settled = generated(server)
        time.sleep(1.0)
        assert generated(server) == settled
        # the server closed the connection it could not finish (what was buffered may still
        # arrive first: read it all, then the end)
        sock.settimeout(10.0)
        while sock.recv(65536):
            pass
    finally:
        sock.close()


def test_a_slow_reader_is_not_cut_off(server: Server) -> None:
    """Reading a little every half second (under the timeout) keeps a stream alive to its end."""
    body = {"prompt": "Once upon a time", "max_tokens": 60, "stream": True, "ignore_eos": True}
    with server.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        chunks = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line)
                if len(chunks) % 20 == 0:
                    time.sleep(STALL_S / 4)
    assert chunks[-1] == "data: [DONE]"
    assert sum('"text"' in c for c in chunks) >= 60
