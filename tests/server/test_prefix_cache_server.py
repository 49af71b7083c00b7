"""The prefix cache over HTTP with the openai client (issue 13 part 4): the second turn of a chat
reports the prompt tokens it found cached (``usage.prompt_tokens_details.cached_tokens``,
llama.cpp's ``timings.cache_n``), the counters and gauges say the same, ``/props`` and ``/slots``
show the cache, and ``--no-prefix-cache`` (or ``KVPARK_PREFIX_CACHE=0``) turns it off."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from support.servers import Server, serve_for_module

PAGE = 16
SYSTEM = {
    "role": "system",
    "content": "You are a terse assistant for a hardware shop. Answer in one sentence, never "
    "more, and name a product when you can. " * 4,
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module()


@pytest.fixture(scope="module")
def server_off() -> Iterator[Server]:
    yield from serve_for_module(environ={"KVPARK_PREFIX_CACHE": "0"})


def chat(server: Server, messages: list[dict[str, str]]) -> Any:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
    )


def raw_chat(server: Server, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 12, "temperature": 0}
    out: dict[str, Any] = httpx.post(
        f"{server.base_url}/v1/chat/completions", json=body, timeout=120
    ).json()
    return out


def test_a_second_turn_reports_its_cached_prompt_tokens(server: Server) -> None:
    before = server.metrics()
    turn1 = [SYSTEM, {"role": "user", "content": "Do you sell hammers?"}]
    first = chat(server, turn1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # a cold pool
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And nails?"},
    ]
    second = raw_chat(server, turn2)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt = second["usage"]["prompt_tokens"]
    assert first.usage.prompt_tokens // PAGE * PAGE <= cached < prompt
    assert cached % PAGE == 0
    assert second["timings"]["cache_n"] == cached
    assert second["timings"]["prompt_n"] == prompt - cached  # computed, as llama.cpp counts
    after = server.metrics()
    queries, found = (
        after[f"kvpark_prefix_cache_{name}_total"] - before[f"kvpark_prefix_cache_{name}_total"]
        for name in ("queries", "hits")
    )
    assert queries == first.usage.prompt_tokens + prompt
    assert found == cached
    assert after["kvpark_kv_cells_cached"] >= cached  # both turns' pages stay cached
    props = httpx.get(f"{server.base_url}/props").json()["prefix_cache"]
    assert props["enabled"] is True
    assert props["cells_cached"] == after["kvpark_kv_cells_cached"]
    assert props["pages_cached"] * PAGE == props["cells_cached"]
    slots = httpx.get(f"{server.base_url}/slots").json()
    assert all(s["n_cached_tokens"] == 0 for s in slots)  # idle slots


def test_the_off_switch_computes_every_prompt_token(server_off: Server) -> None:
    turn = [SYSTEM, {"role": "user", "content": "Do you sell hammers?"}]
    for _ in range(2):
        out = raw_chat(server_off, turn)
        assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert out["timings"]["cache_n"] == 0
    assert server_off.metric("kvpark_prefix_cache_hits_total") == 0
    assert server_off.metric("kvpark_kv_cells_cached") == 0
    props = httpx.get(f"{server_off.base_url}/props").json()["prefix_cache"]
    assert props == {"enabled": False, "cells_cached": 0, "pages_cached": 0}


@pytest.fixture(scope="module")
def exact_server() -> Iterator[Server]:
    yield from serve_for_module("--exact", "--max-batch-tokens", "40")


def test_exact_mode_gives_a_warm_request_the_bits_of_a_cold_one(exact_server: Server) -> None:
    """On a fresh ``--exact`` server the first request runs cold; after another request with the
    same system prompt, the same request again finds its prefix cached, in chunks of 40 rows,
    and its logprobs are the same floats."""
    question = [SYSTEM, {"role": "user", "content": "Which drill for concrete?"}]
    body = {"messages": question, "max_tokens": 10, "temperature": 0, "logprobs": True}

    def ask() -> dict[str, Any]:
        out: dict[str, Any] = httpx.post(
            f"{exact_server.base_url}/v1/chat/completions", json=body, timeout=120
        ).json()
        return out

    cold = ask()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    raw_chat(exact_server, [SYSTEM, {"role": "user", "content": "Do you sell hammers?"}])
    warm = ask()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= PAGE * 4
    lp = [[t["logprob"] for t in r["choices"][0]["logprobs"]["content"]] for r in (cold, warm)]
    assert lp[0] == lp[1] and len(lp[0]) == 10
