"""``POST /v1/embeddings`` over HTTP: the vectors are the model's (mean-pooled final-norm hidden
states, normalised), the ``openai`` client reads them in both encodings, bad bodies are 400s that
name their field, embeddings computed beside running chat streams change none of their tokens
and hold no KV cell, and a client that leaves drops the inputs not yet run.

The numbers are judged as tests/model/test_model_parity.py judges logits, with no tolerance measured
on one machine: against transformers run in float64 on the same GGUF weights, our float32 error may
be at most :data:`FP32_FACTOR` times transformers' own float32 error on the same input (two float32
implementations differ in summation order, not in error size), plus one float32 rounding of the
largest component.
"""

from __future__ import annotations

import base64
import copy
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from support.hf_runner import load_hf_llama
from support.servers import Server, launch_server, stop_server, wait_healthy

MAX_MODEL_LEN = 512
HIDDEN = 576  # SmolLM2-135M's hidden size: the embedding's length
FP32_FACTOR = 4.0
TEXTS = [
    "Hello world",
    "Explain in two sentences why the sky is blue.",
    "a",
    # long enough for prompt-sized GEMMs (more than cpu_paths.PROMPT_MIN_ROWS rows)
    " ".join(f"Item {i} of the list is a small red box." for i in range(20)),
]
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Count to five."]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    """The default arithmetic, exact mode, and a custom runner with no ``embed`` (loading at
    once, so their start-up overlaps)."""
    started = {
        "default": launch_server("--max-model-len", str(MAX_MODEL_LEN)),
        "exact": launch_server("--exact", "--max-batch-tokens", "24"),
        "echo": launch_server("--runner", "kvpark.runner.echo_runner:EchoRunner"),
    }
    try:
        for server in started.values():
            wait_healthy(server)
        yield started
    finally:
        stop_server(*started.values())


@pytest.fixture(scope="module")
def server(servers: dict[str, Server]) -> Server:
    return servers["default"]


@pytest.fixture(scope="module")
def hf(default_gguf_path: str) -> tuple[Any, Any]:
    """transformers' model on the GGUF in float32, and a float64 copy of it."""
    model = load_hf_llama(default_gguf_path)
    return model, copy.deepcopy(model).double()


def client_for(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def token_ids(server: Server, text: str) -> list[int]:
    """What the server tokenizes an input to (with the tokenizer's special tokens)."""
    with server.client() as c:
        body = {"content": text, "add_special": True}
        tokens: list[int] = c.post("/tokenize", json=body).json()["tokens"]
    return tokens


def pooled(model: Any, ids: list[int]) -> torch.Tensor:
    """The reference: transformers' last hidden state (after its final norm), mean, L2 norm."""
    with torch.inference_mode():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(hidden.mean(dim=0), dim=0).double()


def post(server: Server, body: dict[str, object]) -> httpx.Response:
    with server.client() as c:
        response: httpx.Response = c.post("/v1/embeddings", json=body)
    return response


def floats(server: Server, body: dict[str, object]) -> list[list[float]]:
    response = post(server, body)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return [d["embedding"] for d in data]


@pytest.mark.parametrize("mode", ["default", "exact"])
def test_vectors_match_transformers_in_order(
    servers: dict[str, Server], hf: tuple[Any, Any], mode: str
) -> None:
    server = servers[mode]
    result = client_for(server).embeddings.create(
        model="default", input=TEXTS, encoding_format="float"
    )
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    ids = [token_ids(server, t) for t in TEXTS]
    assert len(ids[-1]) > 64
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    f32, f64 = hf
    for item, prompt in zip(result.data, ids, strict=True):
        ours = torch.tensor(item.embedding, dtype=torch.float64)
        assert ours.shape == (HIDDEN,)
        want = pooled(f64, prompt)
        hf_error = (pooled(f32, prompt) - want).abs().max().item()
        bound = FP32_FACTOR * hf_error + want.abs().max().item() * 2.0**-23
        assert (ours - want).abs().max().item() <= bound
        assert abs(ours.norm().item() - 1.0) < 1e-6


def test_openai_client_base64_default_and_raw_base64_decode_to_the_float_vectors(
    server: Server,
) -> None:
    want = floats(server, {"input": TEXTS[:2]})
    # the client asks for base64 when not told, and decodes it to floats itself
    got = client_for(server).embeddings.create(model="default", input=TEXTS[:2])
    assert [d.embedding for d in got.data] == want
    raw = post(server, {"input": TEXTS[:2], "encoding_format": "base64"}).json()["data"]
    decoded = [list(struct.unpack(f"<{HIDDEN}f", base64.b64decode(d["embedding"]))) for d in raw]
    assert decoded == want


def test_token_id_inputs_and_no_op_fields_give_the_text_inputs_vectors(server: Server) -> None:
    texts = floats(server, {"input": TEXTS[:2]})
    ids = [token_ids(server, t) for t in TEXTS[:2]]
    assert floats(server, {"input": ids}) == texts
    assert floats(server, {"input": ids[1]}) == texts[1:]
    assert floats(server, {"input": TEXTS[1]}) == texts[1:]
    same = {"input": TEXTS[:2], "user": "someone", "dimensions": HIDDEN, "model": "default"}
    assert floats(server, same) == texts
    assert texts[0] != texts[1]


BAD = [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [[1], "a"]}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": [True]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["Hi", ""]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": ["Hi"] * 257}, "input"),
    ({"input": "Hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "Hi", "dimensions": 3}, "dimensions"),
    ({"input": "Hi", "dimensions": "576"}, "dimensions"),
    ({"input": "Hi", "user": 7}, "user"),
    ({"input": "Hi", "model": 7}, "model"),
    ({"input": "Hi", "pooling": "cls"}, "pooling"),
]


@pytest.mark.parametrize(("body", "field"), BAD)
def test_bad_bodies_are_400s_naming_the_field(
    server: Server, body: dict[str, object], field: str
) -> None:
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert error["type"] == "invalid_request_error"
    assert error["code"] == 400


def test_too_long_input_and_unknown_model_then_the_server_keeps_serving(server: Server) -> None:
    response = post(server, {"input": [[1] * (MAX_MODEL_LEN + 1)]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input" and error["type"] == "exceed_context_size_error"
    assert str(MAX_MODEL_LEN) in error["message"]
    assert len(floats(server, {"input": [[1] * MAX_MODEL_LEN]})[0]) == HIDDEN  # the limit itself
    response = post(server, {"input": "Hi", "model": "gpt-4"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    assert len(floats(server, {"input": "Hi"})[0]) == HIDDEN
    server.wait_cells_free()


def test_a_runner_without_embed_is_a_501_that_says_so(servers: dict[str, Server]) -> None:
    response = post(servers["echo"], {"input": "Hi"})
    assert response.status_code == 501, response.text
    error = response.json()["error"]
    assert "EchoRunner" in error["message"] and "embed" in error["message"]
    with servers["echo"].client() as c:  # and it still generates
        done = c.post("/v1/completions", json={"prompt": "a b a", "max_tokens": 3})
        assert done.status_code == 200, done.text


def chat(server: Server, question: str) -> str:
    stream = client_for(server).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": question}],
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_embeddings_beside_chat_streams_change_neither(servers: dict[str, Server]) -> None:
    """Exact mode: a stream's tokens must not depend on what runs beside it, so any change would
    be the embeddings' doing; and the embeddings, run between steps, keep their bits too."""
    server = servers["exact"]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        alone = list(pool.map(lambda q: chat(server, q), QUESTIONS))
    body: dict[str, object] = {"input": TEXTS}
    first = floats(server, body)
    stop, during, answers = threading.Event(), threading.Event(), []

    def hammer() -> None:
        while not stop.is_set():
            answers.append((floats(server, body), during.is_set()))

    worker = threading.Thread(target=hammer)
    worker.start()
    try:
        time.sleep(0.5)  # an embedding job is in flight when the streams start
        during.set()
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            beside = list(pool.map(lambda q: chat(server, q), QUESTIONS))
        during.clear()
    finally:
        stop.set()
        worker.join(120)
    assert beside == alone
    assert all(len(text) > 0 for text in alone)
    assert any(in_streams for _, in_streams in answers), "no embedding ran beside the streams"
    assert all(vectors == first for vectors, _ in answers)
    server.wait_cells_free()


def test_a_client_that_leaves_drops_the_inputs_not_yet_run(server: Server) -> None:
    """A request of many long inputs whose client gives up at once must not keep the engine busy:
    the next request is answered in far less time than the abandoned inputs would take."""
    long_input = [[i % 1000 + 1 for i in range(128)]]
    started = time.monotonic()
    floats(server, {"input": long_input})
    one = time.monotonic() - started  # one long input's forward (and a round trip)
    with server.client(timeout=2 * one) as c, pytest.raises(httpx.TimeoutException):
        c.post("/v1/embeddings", json={"input": long_input * 256})
    started = time.monotonic()
    assert len(floats(server, {"input": "Hi"})[0]) == HIDDEN
    # had the 256 inputs all run, this answer would have waited for about 254 of them
    assert time.monotonic() - started < 64 * one
    server.wait_cells_free()
