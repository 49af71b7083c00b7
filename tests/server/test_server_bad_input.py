"""Everything a client can get wrong gets its 4xx JSON error, and the server keeps serving.

The server runs with an API key, so the same battery also checks that auth comes first. After the
battery a normal request still succeeds and no KV cell is left held.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvpark.server.errors import APIError
from support.servers import Server, serve_for_module

KEY = "test-key-123"
MAX_MODEL_LEN = 1024
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module("--max-model-len", str(MAX_MODEL_LEN), api_key=KEY)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def assert_error(response: httpx.Response, status: int, words: str = "") -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["code"] == status
    assert words.lower() in error["message"].lower()


BAD_COMPLETIONS = [
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[1], "a"]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": "Hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "Hi", "top_k": 2.5}, "top_k"),
    ({"prompt": "Hi", "min_p": 2}, "min_p"),
    ({"prompt": "Hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "Hi", "frequency_penalty": "x"}, "frequency_penalty"),
    ({"prompt": "Hi", "seed": "x"}, "seed"),
    ({"prompt": "Hi", "stop": 3}, "stop"),
    ({"prompt": "Hi", "stop": [""]}, "stop"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": "Hi", "n": 1000}, "n"),
    ({"prompt": "Hi", "stream": "yes"}, "stream"),
    ({"prompt": "Hi", "logprobs": 99}, "logprobs"),
    ({"prompt": "Hi", "logprobs": True}, "logprobs"),
    ({"prompt": "Hi", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "Hi", "stream_options": 3}, "stream_options"),
    ({"prompt": "Hi", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "Hi", "logit_bias": {"a": 5}}, "logit_bias"),
    ({"prompt": "Hi", "suffix": "!"}, "suffix"),
    ({"prompt": "Hi", "grammar": 'root ::= "a"', "guided_regex": "a"}, "guided_regex"),
    ({"prompt": "Hi", "no_such_field": 1}, "no_such_field"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS, ids=lambda v: str(v)[:40])
def test_bad_completion_parameters(
    client: httpx.Client, body: dict[str, object], param: str
) -> None:
    response = client.post("/v1/completions", json=body)
    assert_error(response, 400, param)
    assert response.json()["error"]["param"] == param or param in ("prompt",)


BAD_CHATS = [
    {},
    {"messages": "Hi"},
    {"messages": []},
    {"messages": ["Hi"]},
    {"messages": [{"role": "robot", "content": "Hi"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": HI, "logprobs": "yes"},
    {"messages": HI, "top_logprobs": 3},
    {"messages": HI, "logprobs": True, "top_logprobs": 50},
    {"messages": HI, "max_completion_tokens": -1},
    {"messages": HI, "tools": "none"},
    {"messages": HI, "response_format": {"type": "xml"}},
    {"messages": HI, "functions": [{"name": "f"}]},
    {"messages": HI, "no_such_field": 1},
    {"messages": [{"role": "user", "content": "Hi", "no_such_field": 1}]},
]


@pytest.mark.parametrize("body", BAD_CHATS, ids=lambda v: str(v)[:40])
def test_bad_chat_requests(client: httpx.Client, body: dict[str, object]) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe", b""])
def test_malformed_json(client: httpx.Client, route: str, content: bytes) -> None:
    headers = {"Content-Type": "application/json"}
    assert_error(client.post(route, content=content, headers=headers), 400)


DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
LONE = [  # valid JSON, no text: a surrogate with no partner (a valid pair is fine, last one)
    ("/v1/completions", rb'{"prompt": "Hi \ud800"}', "prompt"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\udc00"}]}',
     "messages[0].content"),
    ("/v1/messages", rb'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", '
     rb'"content": "x\ud83d"}]}', "messages[0].content"),
]  # fmt: skip


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_json_nested_too_deeply_is_a_400(client: httpx.Client, route: str) -> None:
    headers = {"content-type": "application/json"}
    assert_error(client.post(route, content=DEEP, headers=headers), 400, "nested too deeply")


@pytest.mark.parametrize(("route", "content", "field"), LONE)
def test_a_lone_surrogate_is_a_400_naming_its_field(
    client: httpx.Client, route: str, content: bytes, field: str
) -> None:
    response = client.post(route, content=content, headers={"content-type": "application/json"})
    if route == "/v1/messages":  # Anthropic's error shape
        assert response.status_code == 400, response.text
        assert field in response.json()["error"]["message"]
        return
    assert_error(response, 400, "lone UTF-16 surrogate")
    assert response.json()["error"]["param"] == field
    paired = rb'{"prompt": "Hi \ud83d\ude00", "max_tokens": 2}'  # the control: a real pair
    ok = client.post(
        "/v1/completions", content=paired, headers={"content-type": "application/json"}
    )
    assert ok.status_code == 200, ok.text


def test_token_ids_outside_the_vocabulary(client: httpx.Client) -> None:
    for prompt in ([1, 2, 10**9], [-1], [[5, 6], [7, 10**6]]):
        assert_error(client.post("/v1/completions", json={"prompt": prompt}), 400, "invalid tokens")
    assert_error(client.post("/detokenize", json={"tokens": [10**9]}), 400, "invalid tokens")
    assert_error(client.post("/detokenize", json={"tokens": ["a"]}), 400)


def test_a_prompt_longer_than_the_context(client: httpx.Client) -> None:
    long_prompt = [100] * (MAX_MODEL_LEN + 10)
    response = client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1})
    assert_error(response, 400, "context")
    fits_alone = {"prompt": [[100] * 10, long_prompt], "max_tokens": 1}
    assert_error(client.post("/v1/completions", json=fits_alone), 400, "context")
    too_much = {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN + 1}
    assert_error(client.post("/v1/completions", json=too_much), 400)


def test_unknown_model_and_route(client: httpx.Client) -> None:
    body = {"model": "gpt-4o", "prompt": "Hi"}
    assert_error(client.post("/v1/completions", json=body), 404, "gpt-4o")
    assert_error(client.get("/v1/models/gpt-4o"), 404)
    assert_error(client.get("/v2/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_missing_or_wrong_api_key(server: Server) -> None:
    url = f"{server.base_url}/v1/completions"
    assert_error(httpx.post(url, json={"prompt": "Hi"}), 401, "missing")
    wrong = {"Authorization": "Bearer not-the-key"}
    assert_error(httpx.post(url, json={"prompt": "Hi"}, headers=wrong), 401, "invalid")
    assert_error(httpx.get(f"{server.base_url}/metrics", headers={"Authorization": KEY}), 401)
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # open for probes


def test_oversized_body(client: httpx.Client) -> None:
    big = b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    assert_error(client.post("/v1/completions", content=big), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    assert_error(client.post("/v1/completions", content=chunks()), 413)


def test_a_full_queue_is_503_with_retry_after() -> None:
    response = APIError(503, "the wait queue is full").response()
    assert response.status_code == 503 and response.headers["retry-after"] == "1"


def test_the_server_still_serves_and_holds_no_cells(server: Server, client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    server.wait_cells_free()
