"""Streams from a real server, read with raw httpx: chunk format, usage, pings, and disconnects.

The framing of notices and keepalives is tested on its own in test_server_sse.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from support.servers import Server, serve_for_module
from support.sse import sse_data, sse_lines

CHAT = {"messages": [{"role": "user", "content": "Write a haiku."}], "max_tokens": 6}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module("--sse-ping-interval", "0.2")


def stream(server: Server, route: str, body: dict[str, object]) -> tuple[httpx.Response, list[str]]:
    with httpx.stream(
        "POST", f"{server.base_url}{route}", json={**body, "stream": True}, timeout=120
    ) as response:
        if response.status_code != 200:
            response.read()  # an error: plain JSON
            return response, []
        return response, sse_lines(response)


def test_chat_stream_matches_the_unstreamed_answer_and_ends_with_usage(server: Server) -> None:
    body = {**CHAT, "temperature": 0, "stream_options": {"include_usage": True}}
    response, lines = stream(server, "/v1/chat/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    chunks = sse_data(lines)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    whole = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={**CHAT, "temperature": 0}, timeout=120
    ).json()
    assert text == whole["choices"][0]["message"]["content"]
    last = chunks[-1]
    assert last["choices"] == []
    # the same prompt again: its full pages come from the prefix cache, the rest is computed
    cached = whole["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert last["usage"].pop("prompt_tokens_details") == {"cached_tokens": 0}
    assert last["usage"] == whole["usage"]
    assert 0 < cached < whole["usage"]["prompt_tokens"] and cached % 16 == 0
    assert set(last["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms"}
    assert last["preempt"] == {"parks": 0, "recomputes": 0}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])


def test_without_include_usage_the_finishing_chunk_carries_timings(server: Server) -> None:
    _, lines = stream(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    chunks = sse_data(lines)
    assert "usage" not in chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    assert chunks[-1]["timings"]["predicted_n"] >= 1


def test_multi_prompt_stream_with_n_covers_every_choice(server: Server) -> None:
    body = {"prompt": ["Red", "Green"], "n": 2, "max_tokens": 3, "ignore_eos": True}
    _, lines = stream(server, "/v1/completions", body)
    chunks = [c for c in sse_data(lines) if c["choices"]]
    indices = {c["choices"][0]["index"] for c in chunks}
    assert indices == {0, 1, 2, 3}
    done = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(done) == [0, 1, 2, 3]


def test_comments_are_pings_only_and_the_openai_client_ignores_them(server: Server) -> None:
    _, lines = stream(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
    assert {line for line in lines if line.startswith(":")} <= {":"}
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    events = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(events)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_a_refused_stream_is_a_plain_json_error(server: Server) -> None:
    response, _ = stream(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 100_000})
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")


def test_a_bad_sibling_prompt_refuses_the_whole_stream(server: Server) -> None:
    body = {"prompt": [[1, 2, 3], [1, 2, 999_999_999]], "max_tokens": 4}
    response, _ = stream(server, "/v1/completions", body)
    assert response.status_code == 400
    assert "invalid tokens" in response.json()["error"]["message"]
    server.wait_cells_free()


def test_a_client_that_disconnects_mid_stream_gives_its_cells_back(server: Server) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk
    assert server.metric("kvpark_requests_running") <= 1
    server.wait_cells_free(timeout=60)
    assert server.metric("kvpark_requests_running") == 0
    follow_up = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120
    )
    assert follow_up.status_code == 200


def test_a_client_that_gives_up_on_a_plain_request_gives_its_cells_back(server: Server) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=3)
    server.wait_cells_free(timeout=60)
