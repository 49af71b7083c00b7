"""Cache isolation over HTTP (issue 28 part 5): a request's ``cache_salt`` scopes the prefix cache,
so ``cached_tokens`` says nothing about other salts' prompts; ``--cache-salt-by-key`` scopes it by
API key too; exact mode keeps a salted request's bits the same warm or cold. Real ``kvpark serve``
processes, the ``openai`` and ``anthropic`` clients."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from support.servers import Server, serve_for_module

PAGE = 16


def system(topic: str) -> dict[str, str]:
    """A system turn of several pages, its own per test so that tests share no cached page."""
    return {
        "role": "system",
        "content": f"You answer questions about {topic} in one short sentence, naming a part "
        "number when you can and never apologising. " * 4,
    }


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # every request parks every 2 tokens, and every park is a recompute: its resume takes back
    # cached pages by hash, under its own salt
    parks = {"KVPARK_PREEMPT_EVERY": "2", "KVPARK_PREEMPT_FAIL_SAVE": "1"}
    yield from serve_for_module("--exact", environ=parks)


@pytest.fixture(scope="module")
def keyed() -> Iterator[Server]:
    yield from serve_for_module("--api-key", "key-two", "--cache-salt-by-key", api_key="key-one")


def openai_client(server: Server, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=key or server.api_key or "unused", max_retries=0
    )


def chat(server: Server, topic: str, salt: str | None, key: str | None = None, **more: Any) -> Any:
    extra = {} if salt is None else {"cache_salt": salt}
    return openai_client(server, key).chat.completions.create(
        model="default",
        messages=[system(topic), {"role": "user", "content": "Which bolt fits?"}],  # type: ignore[list-item]
        max_tokens=6,
        temperature=0,
        extra_body=extra,
        **more,
    )


def cached(answer: Any) -> int:
    return int(answer.usage.prompt_tokens_details.cached_tokens)


def test_requests_share_cached_pages_only_within_one_salt(server: Server) -> None:
    first = chat(server, "bicycles", "tenant-a")
    assert cached(first) == 0
    again = chat(server, "bicycles", "tenant-a")
    assert cached(again) >= first.usage.prompt_tokens // PAGE * PAGE - PAGE > 0
    # another salt, and no salt, find nothing of tenant-a's pages: the count cannot leak them
    assert cached(chat(server, "bicycles", "tenant-b")) == 0
    assert cached(chat(server, "bicycles", None)) == 0
    # each of those cached its own copy: its next request hits
    assert cached(chat(server, "bicycles", "tenant-b")) == cached(again)
    assert cached(chat(server, "bicycles", None)) == cached(again)
    text = {a.choices[0].message.content for a in (first, again)}
    assert len(text) == 1


def test_exact_mode_keeps_warm_equal_to_cold_under_a_salt(server: Server) -> None:
    runs = [chat(server, "lathes", "s", logprobs=True, top_logprobs=2) for _ in range(2)]
    runs.append(chat(server, "lathes", "another", logprobs=True, top_logprobs=2))
    assert [cached(r) > 0 for r in runs] == [False, True, False]

    def bits(answer: Any) -> list[tuple[str, float, list[float]]]:
        return [
            (t.token, t.logprob, [top.logprob for top in t.top_logprobs])
            for t in answer.choices[0].logprobs.content
        ]

    assert bits(runs[0]) == bits(runs[1]) == bits(runs[2])
    assert all(r.model_extra["preempt"]["recomputes"] > 0 for r in runs)


def test_every_generating_route_takes_the_salt(server: Server) -> None:
    client = openai_client(server)
    prompt = system("kilns")["content"]
    hits = []
    for salt in ("x", "x", "y"):
        done = client.completions.create(
            model="default", prompt=prompt, max_tokens=3, extra_body={"cache_salt": salt}
        )
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        hits.append(done.usage.prompt_tokens_details.cached_tokens)
    assert hits[0] == 0 < hits[1] and hits[2] == 0
    hits = []
    for salt in ("x", "x", "y"):
        response = client.responses.create(
            model="default",
            instructions=system("kettles")["content"],
            input="Which lid?",
            max_output_tokens=3,
            extra_body={"cache_salt": salt},
        )
        assert response.usage is not None
        hits.append(response.usage.input_tokens_details.cached_tokens)
    assert hits[0] == 0 < hits[1] and hits[2] == 0
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    hits = []
    for salt in ("x", "x", "y"):
        message = messages.messages.create(
            model="default",
            system=system("kayaks")["content"],
            messages=[{"role": "user", "content": "Which paddle?"}],
            max_tokens=3,
            extra_body={"cache_salt": salt},
        )
        hits.append(message.usage.cache_read_input_tokens)
    assert hits[0] == 0 and hits[1] and hits[2] == 0


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/responses", {"input": "Hi"}),
        (
            "/v1/messages",
            {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        ),
    ],
)
def test_a_bad_cache_salt_is_a_400_naming_it(
    server: Server, path: str, body: dict[str, Any], salt: object
) -> None:
    answer = httpx.post(f"{server.base_url}{path}", json={**body, "cache_salt": salt}, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert "cache_salt" in error["message"]
    if path != "/v1/messages":  # Anthropic's errors name no param
        assert error["param"] == "cache_salt"


def test_by_key_each_key_has_its_own_cache_whatever_the_salt(keyed: Server) -> None:
    one = chat(keyed, "forklifts", None, key="key-one")
    assert cached(one) == 0
    assert cached(chat(keyed, "forklifts", None, key="key-one")) > 0
    assert cached(chat(keyed, "forklifts", None, key="key-two")) == 0
    # the same salt under two keys is still two scopes, and a salt splits one key's scope
    assert cached(chat(keyed, "forklifts", "shared", key="key-one")) == 0
    assert cached(chat(keyed, "forklifts", "shared", key="key-two")) == 0
    assert cached(chat(keyed, "forklifts", "shared", key="key-two")) > 0
    with pytest.raises(openai.AuthenticationError):
        chat(keyed, "forklifts", None, key="key-three")
