"""Every architecture beyond Llama and Qwen served by a real ``kvpark serve --exact`` (the lean
runner, from a tiny random safetensors checkpoint: tests/support/tiny_arch.py), through the
openai client: a request's tokens are the same alone, beside other streams while every
generating request is parked every few tokens (KVPARK_PREEMPT_EVERY), and again on a warm
prefix cache, which reports the prompt it found; every cell comes back after."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from kvpark.model.gguf_file import GgufFile
from kvpark.model.sources import default_model_path
from kvpark.tokenizer.tokenizer import Tokenizer
from support.servers import Server, start_server, stop_server
from support.tiny_arch import ARCHS, save_arch

QUESTION = "Name three rivers in Europe and say where each of them flows, in detail. " * 2
OTHERS = ["Write a limerick about a cat.", "Explain recursion.", "What is 17 times 23?"]
NEW = 24  # past the 8-position window, and three forced parks of each stream


@pytest.fixture(scope="module", params=list(ARCHS))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(request.param)
    save_arch(
        request.param, Tokenizer.from_gguf_metadata(GgufFile(default_model_path()).metadata), root
    )
    s = start_server(
        "--model", str(root), "--exact", "--runner", "lean",
        environ={"KVPARK_PREEMPT_EVERY": "8"},
    )  # fmt: skip
    try:
        yield s
    finally:
        stop_server(s)
        shutil.rmtree(root, ignore_errors=True)  # ~100 MB a model (the real vocabulary)


def ask(server: Server, text: str) -> tuple[list[tuple[str, float]], int]:
    """The greedy completion's tokens with their logprobs, and the cached prompt tokens."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": text}],
        max_tokens=NEW,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    tokens = [(item.token, item.logprob) for item in choice.logprobs.content]
    usage = out.usage
    assert usage is not None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return tokens, int(cached or 0)


def test_parks_and_the_prefix_cache_change_no_token(server: Server) -> None:
    alone, _ = ask(server, QUESTION)
    assert len(alone) == NEW
    parks_before = parks(server)
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(ask, server, text) for text in OTHERS]
        beside = pool.submit(ask, server, QUESTION)
        assert beside.result()[0] == alone
        for o in others:
            assert len(o.result()[0]) == NEW
    assert parks(server) > parks_before  # the streams were parked
    warm, cached = ask(server, QUESTION)
    assert warm == alone and cached > 0
    gauges = server.metrics()
    assert gauges["kvpark_requests_running"] == gauges["kvpark_requests_preempted"] == 0


def parks(server: Server) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("kvpark_preemptions_total"))
