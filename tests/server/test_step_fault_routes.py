"""A failed step on the Responses and Anthropic Messages routes, on a real ``kvpark serve`` with
one slot (docs/server.md, "POST /v1/responses", "POST /v1/messages"): a Responses stream ends with
an ``error`` event and then ``response.failed`` (status ``failed``, ``error: {code, message}``),
a Messages stream with ``event: error`` (an ``api_error``), and a plain request on either with a
500 in its API's shape. The server keeps serving after each.

``KVPARK_FAULT_STEP`` takes a comma list here. The requests run one at a time, each of
``STEP_GAP - 1`` tokens before its step fails; steps count only when the model runs, so each
request's faulted step is ``STEP_GAP`` after the one before it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from support.servers import Server, serve_for_module

STEP_GAP = 4  # a request's first STEP_GAP - 1 steps run; the next one fails
FAULTS = ",".join(str(STEP_GAP * k) for k in range(1, 5))
MESSAGES = [{"role": "user", "content": "Tell me a long story about a dragon."}]
FAILED = "internal error while running the model"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module("--parallel", "1", environ={"KVPARK_FAULT_STEP": FAULTS})


def typed_events(response: httpx.Response) -> list[tuple[str, dict[str, object]]]:
    """``(event:, data:)`` pairs of a typed SSE stream, comments skipped."""
    pairs: list[tuple[str, dict[str, object]]] = []
    kind = ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            pairs.append((kind, json.loads(line.removeprefix("data: "))))
    return pairs


def test_faulted_steps_end_each_route_in_its_own_words(server: Server) -> None:
    # 1. a Responses stream: error, then response.failed, sequence numbers unbroken
    body = {"model": "default", "input": MESSAGES, "max_output_tokens": 64, "temperature": 0}
    stream_body = {**body, "stream": True}
    with (
        server.client() as client,
        client.stream("POST", "/v1/responses", json=stream_body) as sent,
    ):
        assert sent.status_code == 200
        events = typed_events(sent)
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-2:] == ["error", "response.failed"], kinds
    assert [data["type"] for _, data in events] == kinds
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    error = events[-2][1]
    assert (error["code"], error["message"]) == ("500", FAILED)
    failed = events[-1][1]["response"]
    assert isinstance(failed, dict) and failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": FAILED}
    deltas = "".join(str(d["delta"]) for k, d in events if k == "response.output_text.delta")
    assert deltas and failed["output_text"] == deltas  # what it wrote before the step failed
    assert failed["output"][-1]["status"] == "incomplete"
    assert failed["usage"] is None  # the engine's tally never came

    # 2. a Messages stream: event: error, an api_error, through the anthropic client
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="-", max_retries=0)
    text: list[str] = []
    opened = claude.messages.stream(model="default", max_tokens=64, messages=MESSAGES)
    with pytest.raises(anthropic.APIStatusError) as raised, opened as stream:
        text.extend(stream.text_stream)
    assert "".join(text)  # the stream had started
    assert raised.value.body == {"type": "error", "error": {"type": "api_error", "message": FAILED}}

    # 3. a plain Messages request: a 500 in Anthropic's shape
    with pytest.raises(anthropic.InternalServerError) as plain:
        claude.messages.create(model="default", max_tokens=64, messages=MESSAGES)
    assert plain.value.body == {"type": "error", "error": {"type": "api_error", "message": FAILED}}

    # 4. a plain Responses request: a 500 in OpenAI's shape
    gpt = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.InternalServerError) as answer:
        gpt.responses.create(model="default", input="Tell me a long story.", max_output_tokens=64)
    assert answer.value.status_code == 500
    assert isinstance(answer.value.body, dict) and answer.value.body["message"] == FAILED

    # 5. every failed step checked the pool; nothing is held; the server serves on
    log = server.wait_for_log("after a failed step")
    for step in FAULTS.split(","):
        assert f"KVPARK_FAULT_STEP={step}: the model failed in this step" in log
    assert log.count("the KV pool's integrity check passed after a failed step") == 4
    server.wait_cells_free()
    fine = gpt.responses.create(model="default", input="Say hi.", max_output_tokens=4)
    assert fine.status in ("completed", "incomplete") and fine.output_text
