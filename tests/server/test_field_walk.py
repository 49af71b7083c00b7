"""Every field the chat and completions bodies declare is honoured, refused or a declared no-op.

For each route the table below must hold an entry for every field of its body model
(``Model.model_fields``): a field added without one fails :func:`test_every_field_has_an_entry`.
Each entry is checked against the real default model behind a real server: an honoured field,
sent on top of a baseline, changes the output (greedy baselines, or seeded sampling for the
sampling knobs, so each output is deterministic); a refused one is a 400 naming it; a no-op
(``user``, ``metadata``, ``store``, ``service_tier``) is accepted and changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from kvpark.server.openai_bodies import ChatCompletionBody, CompletionBody
from support.servers import Server, serve_for_module

JSON = dict[str, Any]
COUNT = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
CHAT_BASE: JSON = {"messages": COUNT, "max_tokens": 8, "temperature": 0}
COMPLETION_BASE: JSON = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 8, "temperature": 0}
SUM = "What is 2+2? Answer with a number only."
# a conversation the model ends by itself well before max_tokens: ignore_eos has an EOS to ignore
CHAT_EOS: JSON = {"messages": [{"role": "user", "content": SUM}], "max_tokens": 16}
COMPLETION_EOS: JSON = {
    "prompt": f"<|im_start|>user\n{SUM}<|im_end|>\n<|im_start|>assistant\n",
    "max_tokens": 16,
}
SAMPLED: JSON = {"temperature": 1.5, "seed": 7}  # seeded: sampling fields change a fixed draw
# Penalties act on tokens already out, so they need an output long enough to repeat some whose
# lead is not overwhelming: a seeded poem in chat, greedy prose in completions (the number
# sequence's commas lead by more than a presence penalty of 2 nats: since the attention's sums
# were fused, 2026-12-07, that penalty left " 6, 7, 8, ..." as it was).
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
CHAT_PENALTY: JSON = {"messages": POEM, "temperature": 0.8, "seed": 7, "max_tokens": 24}
COMPLETION_PENALTY: JSON = {"prompt": "The sea is", "max_tokens": 24}
SCHEMA: JSON = {
    "type": "object",
    "properties": {"count": {"type": "integer"}},
    "required": ["count"],
}
GBNF = 'root ::= "yes" | "no"'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
VOLATILE = ("id", "created", "timings", "preempt", "system_fingerprint")


@dataclass(frozen=True)
class Tokens:
    comma: int
    newline: int
    zebra: int


Value = Callable[[Tokens], Any] | Any


@dataclass(frozen=True)
class Changes:
    """Honoured: ``base`` + {field: value} answers 200 with another output than ``base``."""

    value: Value
    base: Value = field(default_factory=dict)


@dataclass(frozen=True)
class Refused:
    value: Value
    base: Value = field(default_factory=dict)
    status: int = 400


@dataclass(frozen=True)
class NoOp:
    value: Any


Entry = Changes | Refused | NoOp

SHARED: dict[str, Entry] = {
    "model": Refused("no-such-model", status=404),
    "stream": Changes(True),
    "stream_options": Changes({"include_usage": True}, base={"stream": True}),
    "max_tokens": Changes(3),
    "n": Changes(2),
    "temperature": Changes(1.5, base={"seed": 7}),
    "top_p": Changes(0.05, base=SAMPLED),
    "seed": Changes(8, base=SAMPLED),
    "logit_bias": Changes(lambda t: {str(t.zebra): 100}),
    "user": NoOp("user-1234"),
    "response_format": Changes({"type": "json_object"}),
    "grammar": Changes(GBNF),
    "json_schema": Changes(SCHEMA),
    "guided_json": Changes(SCHEMA),
    "guided_regex": Changes("[a-c]{3}"),
    "guided_choice": Changes(["alpha", "beta"]),
    "guided_grammar": Changes(GBNF),
    "top_k": Changes(1, base=SAMPLED),
    "min_p": Changes(0.9, base=SAMPLED),
    "best_of": Refused(3),
    # honoured by the prefix cache alone (which cached pages a request may take: that is
    # tests/server/test_cache_salt.py); with the cache off here it must change no output
    "cache_salt": NoOp("tenant-a"),
}
CHAT: dict[str, Entry] = {
    **SHARED,
    "messages": Changes([{"role": "user", "content": "Name three colours."}]),
    "max_completion_tokens": Changes(3),
    "ignore_eos": Changes(True, base=CHAT_EOS),
    "presence_penalty": Changes(2.0, base=CHAT_PENALTY),
    "frequency_penalty": Changes(2.0, base=CHAT_PENALTY),
    "repetition_penalty": Changes(2.0, base=CHAT_PENALTY),
    # the greedy count is "1. 1\n2. 2\n...": newlines to stop at
    "stop": Changes("\n"),
    "stop_token_ids": Changes(lambda t: [t.newline]),
    "min_tokens": Changes(6, base=lambda t: {"stop_token_ids": [t.newline]}),
    "logprobs": Changes(True),
    "top_logprobs": Changes(2, base={"logprobs": True}),
    "tools": Changes(TOOLS),
    "tool_choice": Changes("required", base={"tools": TOOLS}),
    "parallel_tool_calls": Refused(False),  # honoured with tools; alone there is nothing to run
    "modalities": Refused(["text", "audio"]),
    "metadata": NoOp({"project": "walk"}),
    "store": NoOp(True),
    "service_tier": NoOp("auto"),
    "audio": Refused({"voice": "alloy", "format": "wav"}),
    "prediction": Refused({"type": "content", "content": "1, 2, 3"}),
    "web_search_options": Refused({}),
    "reasoning_effort": Refused("low"),
    "verbosity": Refused("low"),
    "prompt_cache_key": Refused("key"),
    "safety_identifier": Refused("user-1234"),
    "functions": Refused([TOOLS[0]["function"]]),
    "function_call": Refused("auto"),
}
COMPLETION: dict[str, Entry] = {
    **SHARED,
    "prompt": Changes("Once upon a time"),
    "ignore_eos": Changes(True, base=COMPLETION_EOS),
    "presence_penalty": Changes(2.0, base=COMPLETION_PENALTY),
    "frequency_penalty": Changes(2.0, base=COMPLETION_PENALTY),
    "repetition_penalty": Changes(2.0, base=COMPLETION_PENALTY),
    # the greedy continuation is " 6, 7, 8, ...": commas to stop at
    "stop": Changes(","),
    "stop_token_ids": Changes(lambda t: [t.comma]),
    "min_tokens": Changes(6, base=lambda t: {"stop_token_ids": [t.comma]}),
    "logprobs": Changes(2),
    "echo": Changes(True),
    "suffix": Refused(" 9, 10"),  # the default model has no fill-in-the-middle tokens
}
ROUTES = {
    "/v1/chat/completions": (ChatCompletionBody, CHAT_BASE, CHAT),
    "/v1/completions": (CompletionBody, COMPLETION_BASE, COMPLETION),
}
CASES = [(route, name) for route, (_, _, table) in ROUTES.items() for name in table]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # no prefix cache: a cached prefix may round differently, and a no-op must change nothing
    yield from serve_for_module("--no-prefix-cache", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def tokens(client: httpx.Client) -> Tokens:
    def first(text: str) -> int:
        ids = client.post("/tokenize", json={"content": text}).json()["tokens"]
        return int(ids[0])

    return Tokens(comma=first(","), newline=first("\n"), zebra=first(" zebra"))


def observe(response: httpx.Response) -> object:
    """What a response says, without what differs between any two requests (ids, times)."""
    if response.status_code != 200:
        return ("error", response.status_code, response.json()["error"].get("param"))
    if response.headers["content-type"].startswith("text/event-stream"):
        chunks = [
            json.loads(line[len("data: ") :])
            for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        return ("stream", [_steady(c) for c in chunks])
    return ("json", _steady(response.json()))


def _steady(obj: JSON) -> JSON:
    out = {k: v for k, v in obj.items() if k not in VOLATILE}
    if isinstance(out.get("usage"), dict):
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


def resolve(value: Value, tokens: Tokens) -> Any:
    return value(tokens) if callable(value) else value


def test_every_field_has_an_entry() -> None:
    for route, (model, _, table) in ROUTES.items():
        assert set(model.model_fields) == set(table), route


@pytest.mark.parametrize(("route", "name"), CASES, ids=[f"{r[4:]}:{n}" for r, n in CASES])
def test_the_field_is_honoured_refused_or_a_no_op(
    client: httpx.Client, tokens: Tokens, route: str, name: str
) -> None:
    _, route_base, table = ROUTES[route]
    entry = table[name]
    extra = {} if isinstance(entry, NoOp) else resolve(entry.base, tokens)
    base = {**route_base, **extra}
    baseline = client.post(route, json=base)
    assert baseline.status_code == 200, baseline.text
    sent = {**base, name: resolve(entry.value, tokens)}
    response = client.post(route, json=sent)
    if isinstance(entry, Refused):
        assert response.status_code == entry.status, response.text
        error = response.json()["error"]
        assert error["param"] == name and name in error["message"], error
        return
    assert response.status_code == 200, response.text
    if isinstance(entry, NoOp):
        assert observe(response) == observe(baseline)
    else:
        assert observe(response) != observe(baseline), f"{name} changed nothing"


@pytest.mark.parametrize("route", list(ROUTES))
def test_an_unknown_field_is_a_400_naming_it(client: httpx.Client, route: str) -> None:
    response = client.post(route, json={**ROUTES[route][1], "max_tokenz": 3})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokenz"


def test_the_openai_client_hears_about_an_unknown_field(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model="default", messages=COUNT, max_tokens=2, extra_body={"top_n": 3}
        )
    assert chat.value.param == "top_n" and "top_n" in chat.value.message
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(
            model="default", prompt="1, 2,", max_tokens=2, extra_body={"guided_xml": "<a/>"}
        )
    assert completion.value.param == "guided_xml"
    # and the server keeps serving
    ok = client.completions.create(model="default", prompt="1, 2,", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_echo_puts_the_prompt_first_streamed_or_not(client: httpx.Client) -> None:
    body = {**COMPLETION_BASE, "echo": True}
    plain = client.post("/v1/completions", json={**COMPLETION_BASE}).json()
    echoed = client.post("/v1/completions", json=body).json()
    generated = plain["choices"][0]["text"]
    assert echoed["choices"][0]["text"] == COMPLETION_BASE["prompt"] + generated
    stream = observe(client.post("/v1/completions", json={**body, "stream": True}))
    assert isinstance(stream, tuple) and stream[0] == "stream"
    texts = [c["choices"][0]["text"] for c in stream[1] if c["choices"]]
    assert texts[0] == COMPLETION_BASE["prompt"]
    assert "".join(texts[1:]) == generated


def test_the_server_holds_no_cells_after_the_walk(server: Server) -> None:
    server.wait_cells_free()
