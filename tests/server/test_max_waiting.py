"""``--max-waiting`` counts embeddings too, and ``--max-waiting 0`` means no request waits
(docs/server.md, "Streams"): with one slot busy, a completion gets a plain 503 with
``Retry-After``; so does an embedding request while another one runs (the second would wait
behind it), with the same body; once the stream ends, both kinds are served again.
On a real ``kvpark serve`` with ``--parallel 1``."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from support.servers import Server, serve_for_module

BUSY = "the server is busy: the wait queue is full"
LONG_INPUTS = ["an input to embed, " * 12] * 16  # a job of 16 turns of the engine loop


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module("--max-waiting", "0", "--parallel", "1")


def assert_busy(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"]
    assert response.json()["error"]["message"] == BUSY


def test_nothing_waits_at_max_waiting_0(server: Server) -> None:
    stream = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json=stream) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # in the slot
            assert_busy(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}))
            # embeddings use no slot: one runs beside the stream, a second would wait
            first: list[httpx.Response] = []

            def embed_long() -> None:
                # it is itself refused when it arrives while a short one runs: it tries again
                while True:
                    answer = http.post("/v1/embeddings", json={"input": LONG_INPUTS})
                    if answer.status_code != 503:
                        first.append(answer)
                        return
                    assert_busy(answer)

            job = threading.Thread(target=embed_long)
            job.start()
            refused = None
            while job.is_alive() and refused is None:
                answer = http.post("/v1/embeddings", json={"input": "short"})
                if answer.status_code != 200:
                    refused = answer
            job.join()
            assert refused is not None, "no second embedding was refused while the first ran"
            assert_busy(refused)
            assert first[0].status_code == 200 and len(first[0].json()["data"]) == len(LONG_INPUTS)
        # the stream is gone (closed early: aborted); the slot is free again
        server.wait_cells_free(timeout=10.0)
        done = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert done.status_code == 200, done.text
        assert http.post("/v1/embeddings", json={"input": "short"}).status_code == 200
