"""``kvpark serve --exact`` over HTTP with the openai client: /props says so, and a streamed
request's tokens and logprobs are the same alone and while other streams run beside it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from support.servers import Server, serve_for_module

QUESTION = [{"role": "user", "content": "Name three rivers in Europe and say where they flow."}]
OTHERS = [
    "Write a limerick about a cat.",
    "Explain recursion to a child.",
    "What is 17 times 23? Show your working.",
]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module("--exact", "--max-batch-tokens", "24")


def ask(server: Server, text: str | None, seed: int) -> tuple[list[str], list[float]]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    messages = QUESTION if text is None else [{"role": "user", "content": text}]
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0.8,
        seed=seed,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    tokens, logprobs = [], []
    for chunk in stream:
        for choice in chunk.choices:
            for item in (choice.logprobs.content or []) if choice.logprobs else []:
                tokens.append(item.token)
                logprobs += [item.logprob, *(t.logprob for t in item.top_logprobs)]
    return tokens, logprobs


def test_props_say_exact_mode_runs(server: Server) -> None:
    with server.client() as client:
        assert client.get("/props").json()["exact"] is True


def test_a_stream_is_bit_identical_alone_and_beside_others(server: Server) -> None:
    alone = ask(server, None, seed=11)
    assert len(alone[0]) == 16
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(ask, server, text, i) for i, text in enumerate(OTHERS)]
        beside = pool.submit(ask, server, None, 11)
        assert beside.result() == alone
        assert all(len(o.result()[0]) > 0 for o in others)
    server.wait_cells_free()
