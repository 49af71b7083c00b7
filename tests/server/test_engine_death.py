"""An engine that dies or wedges ends the server, on a real ``kvpark serve`` (docs/server.md,
"Failures and shutdown"): ``KVPARK_FAULT_DIE`` makes the engine thread's loop raise outside any
step, ``KVPARK_FAULT_WEDGE`` makes a step never return (caught by ``--engine-timeout``). Either
way the running stream ends with its choice's ``finish_reason: "error"`` and the error, the
request queued behind it with a 500, ``/health`` answers 503 with the reason, a new request a 503
with ``Retry-After``, and the process exits with status 1.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from support.servers import Server, launch_server, stop_server, wait_healthy
from support.sse import sse_data

FAULT_AT = 10  # the step (of the stream, which runs alone until then) where the engine goes
ENGINE_TIMEOUT_S = 1.0
EXIT_TIMEOUT_S = 30.0
LONG = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True}
REASONS = {
    "die": "the engine thread died: EngineThreadFault: KVPARK_FAULT_DIE=10: the engine thread "
    "fails",
    "wedge": "the engine thread made no progress for 1 s (--engine-timeout)",
}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    flags = ("--parallel", "1", "--engine-timeout", str(ENGINE_TIMEOUT_S))
    launched = {
        "die": launch_server(*flags, environ={"KVPARK_FAULT_DIE": str(FAULT_AT)}),
        "wedge": launch_server(*flags, environ={"KVPARK_FAULT_WEDGE": str(FAULT_AT)}),
    }
    try:
        for server in launched.values():  # both load at once
            wait_healthy(server)
        yield launched
    finally:
        stop_server(*launched.values())


@pytest.mark.parametrize("fault", ["die", "wedge"])
def test_a_dead_or_wedged_engine_fails_every_request_and_the_process_exits_1(
    servers: dict[str, Server], fault: str
) -> None:
    server, reason = servers[fault], REASONS[fault]
    queued: dict[str, Any] = {}

    def plain() -> None:  # waits behind the stream, which holds the one slot
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
        try:
            client.completions.create(model="default", prompt="Hello", max_tokens=4)
        except openai.APIStatusError as e:
            queued["error"] = e

    with server.client() as client:
        body = client.build_request("POST", "/v1/completions", json=LONG)
        response = client.send(body, stream=True)
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = [next(line for line in lines if line.startswith("data: "))]
        sender = threading.Thread(target=plain, daemon=True)
        sender.start()
        seen.extend(line for line in lines if line)
        # the stream heard it at once, before anything else
        health = client.get("/health")
        refused = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})

    assert seen[-1] == "data: [DONE]", seen
    chunks = sse_data(seen)
    error = chunks[-1]["error"]
    assert error["message"] == f"the engine failed: {reason}" and error["code"] == 500
    assert chunks[-2]["choices"][0]["finish_reason"] == "error"
    tokens = [c for c in chunks[:-2] if c.get("choices")]
    assert 1 <= len(tokens) <= FAULT_AT and all(
        c["choices"][0]["finish_reason"] is None for c in tokens
    )

    assert health.status_code == 503
    assert health.json() == {"status": "failed", "reason": reason}
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["message"] == f"the engine failed: {reason}"

    sender.join(EXIT_TIMEOUT_S)
    assert isinstance(queued.get("error"), openai.InternalServerError), queued
    assert queued["error"].body["message"] == f"the engine failed: {reason}"

    try:
        code = server.process.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after the engine failed:\n{server.log()}") from None
    assert code == 1, server.log()
    log = server.log()
    assert f"the engine failed ({reason}): answering 503, exiting with status 1" in log
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.base_url}/health", timeout=2)
