"""The OpenAI-compatible routes against a real server, with the ``openai`` client unchanged.

Completions and chat (single prompt, several prompts, token ids, n), stop, seeds, logprobs, and the
llama.cpp-style utility routes (/health, /tokenize, /detokenize, /props, /slots, /metrics), all on
one server. The names the model answers to and what the server logs are test_server_names_logs.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvpark import _core
from kvpark.runner.cpu_paths import choose
from support.metrics import parse_metrics
from support.servers import SLOT_FIELDS, Server, serve_for_module

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_one_served_model(client: openai.OpenAI, server: Server) -> None:
    models = client.models.list().data
    assert len(models) == 1
    assert models[0].object == "model"
    assert httpx.get(f"{server.base_url}/v1/models/{models[0].id}").status_code == 200


def test_health_is_ok_once_loaded(server: Server) -> None:
    response = httpx.get(f"{server.base_url}/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_chat_completion(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage is not None
    assert response.usage.completion_tokens <= MAX_TOKENS
    assert response.usage.total_tokens == (
        response.usage.prompt_tokens + response.usage.completion_tokens
    )


def test_final_object_carries_timings_and_preempt(server: Server) -> None:
    body = {"prompt": "The sky is", "max_tokens": 3, "temperature": 0}
    data = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
    timings = data["timings"]
    assert timings["prompt_n"] == data["usage"]["prompt_tokens"]
    assert timings["predicted_n"] == data["usage"]["completion_tokens"]
    assert timings["prompt_ms"] >= 0 and timings["predicted_ms"] >= 0
    assert data["preempt"] == {"parks": 0, "recomputes": 0}


def test_completion_single_prompt(client: openai.OpenAI, model: str) -> None:
    response = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0
    )
    assert len(response.choices) == 1
    assert response.choices[0].text
    assert response.object == "text_completion"


def test_completion_list_of_prompts_gives_a_choice_each(client: openai.OpenAI, model: str) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    response = client.completions.create(
        model=model, prompt=prompts, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert all(c.text for c in response.choices)
    assert response.usage is not None
    assert response.usage.completion_tokens == 8


def test_completion_token_id_prompts(client: openai.OpenAI, model: str, server: Server) -> None:
    tokenize = {"content": "Hello there", "add_special": True}  # as a text prompt is encoded
    ids = httpx.post(f"{server.base_url}/tokenize", json=tokenize).json()["tokens"]
    text_prompt = client.completions.create(
        model=model, prompt="Hello there", max_tokens=4, temperature=0
    )
    one = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert one.choices[0].text == text_prompt.choices[0].text
    several = client.completions.create(
        model=model, prompt=[ids, ids[:1]], max_tokens=4, temperature=0
    )
    assert len(several.choices) == 2
    assert several.usage is not None
    assert several.usage.prompt_tokens == len(ids) + 1


def test_n_choices_per_prompt_are_indexed_prompt_major(client: openai.OpenAI, model: str) -> None:
    response = client.completions.create(
        model=model, prompt=["Red", "Blue"], n=2, max_tokens=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=3
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_string_cuts_the_output(client: openai.OpenAI, model: str) -> None:
    prompt = "Count: 1, 2, 3, 4,"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    text = full.choices[0].text
    words = text.split()
    assert len(words) >= 2, text
    stop = words[1]
    cut = client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_same_seed_same_text(client: openai.OpenAI, model: str) -> None:
    def sample(seed: int) -> str:
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
        return response.choices[0].message.content or ""

    assert sample(1234) == sample(1234)


def test_chat_logprobs_shape(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert response.usage is not None
    assert len(logprobs.content) == response.usage.completion_tokens
    for entry in logprobs.content:
        assert entry.logprob <= 0
        assert entry.bytes is not None
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_completion_logprobs_shape(client: openai.OpenAI, model: str) -> None:
    response = client.completions.create(model=model, prompt="Hello", max_tokens=4, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    n = len(logprobs.tokens)
    assert n == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_tokenize_detokenize_round_trip(server: Server) -> None:
    text = "Hello world, how are you?"
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"content": text}).json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}).json()
    assert back == {"content": text}
    pieces = httpx.post(
        f"{server.base_url}/tokenize", json={"content": text, "with_pieces": True}
    ).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == text
    special = httpx.post(f"{server.base_url}/tokenize", json={"content": text, "add_special": True})
    assert special.status_code == 200


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/tokenize", {"content": "Hi", "parse_special": True}, "parse_special"),
        ("/tokenize", {"content": 3}, "content"),
        ("/detokenize", {"tokens": [1], "with_pieces": True}, "with_pieces"),
    ],
)
def test_the_utility_routes_refuse_what_they_do_not_know(
    server: Server, route: str, body: dict[str, object], param: str
) -> None:
    answer = httpx.post(f"{server.base_url}{route}", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param


def test_props(server: Server) -> None:
    props = httpx.get(f"{server.base_url}/props").json()
    assert props["pool"] == {"kv_cells": 4096, "page_size": 16, "parallel": 4, "window_cells": None}
    assert props["exact"] is False
    assert set(props["preempt"]) >= {
        "enabled",
        "ram_mib",
        "policy",
        "async",
        "notices",
        "granularity",
    }
    assert props["preempt"]["policy"] == "fcfs"
    # the CPU paths follow the rule on this CPU's flags (cpu_paths.py), the same as in-process
    paths = choose(_core._cpu_features()[1], dtype="float32")
    # the lean runner (the native decoder, no torch) wherever the model is in blocks
    # (runner/lean_runner.py), and then no torch in the server's process
    lean = paths.blocks and paths.prompt_dtype is None
    want = {**paths.describe(), "runner": "lean" if lean else "torch", "torch": not lean}
    assert props["cpu"] == want
    maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    assert ("libtorch_cpu" in maps) == (not lean), "the process maps torch's libraries"
    assert props["cpu"]["dtype"] == "float32"
    assert f"cpu paths ({want['isa']}): decode float32 x" in server.log()  # and the start-up log


def test_slots(server: Server) -> None:
    slots = httpx.get(f"{server.base_url}/slots").json()
    assert len(slots) == 4
    fields = SLOT_FIELDS
    for slot in slots:
        assert set(slot) >= fields
        assert not (slot["is_preempted"] and slot["is_transferring"])


METRICS = [
    "kvpark_kv_cells_used",
    "kvpark_kv_usage_ratio",
    "kvpark_requests_running",
    "kvpark_requests_waiting",
    "kvpark_requests_preempted",
    "kvpark_prompt_tokens_total",
    "kvpark_generation_tokens_total",
    'kvpark_preemptions_total{mode="swap"}',
    'kvpark_preemptions_total{mode="recompute"}',
    "kvpark_resumes_total",
    "kvpark_rotations_total",
    "kvpark_recomputed_tokens_total",
    "kvpark_preempt_ram_bytes",
    "kvpark_time_to_first_token_seconds_bucket",
    "kvpark_inter_token_latency_seconds_count",
    "kvpark_park_duration_seconds_sum",
    "kvpark_transfer_duration_seconds_count",
]


def test_metrics_names_present(server: Server) -> None:
    response = httpx.get(f"{server.base_url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    names = set(parse_metrics(response.text))
    for metric in METRICS:
        assert any(n == metric or n.startswith(metric + "{") for n in names), metric
    assert server.metric("kvpark_prompt_tokens_total") > 0
