"""Every generating route checks its prompts off the event loop.

``engine.check_request`` compiles grammars (a JSON schema, a tool plan), which can take long; run
on the event loop it would stall every other request's stream and ``/health`` meanwhile. The app
here is the real one (``build_app``) over a real engine on the default model, served by uvicorn in
a thread; only ``check_request`` is wrapped, to note where it ran. A call made on the event loop's
thread finds a running loop there; a threadpool worker has none, so the check is exact, not timed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvpark.config.layers import EngineConfig, ServerConfig
from kvpark.engine.async_engine import AsyncEngine
from kvpark.sampling.params import SamplingParams
from kvpark.server.app import build_app
from support.servers import app_in_thread

LOAD_TIMEOUT_S = 300.0
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOL = {"name": "add", "description": "adds", "parameters": SCHEMA}
CHAT = [{"role": "user", "content": "Say hi"}]
# one body per route, each with a constraint to compile where the route has one
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "messages": CHAT,
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    },
    "/v1/completions": {"prompt": ["Hello", "The sky is"], "max_tokens": 2},
    "/v1/responses": {
        "input": "Say hi",
        "max_output_tokens": 2,
        "tools": [{"type": "function", **TOOL}],
        "tool_choice": "required",
    },
    "/v1/messages": {
        "model": "default",
        "messages": CHAT,
        "max_tokens": 2,
        "tools": [{"name": "add", "description": "adds", "input_schema": SCHEMA}],
        "tool_choice": {"type": "any"},
    },
}


@dataclass
class Checks:
    """Where each ``check_request`` ran: True for a thread with a running event loop."""

    on_loop: list[bool] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> list[bool]:
        with self.lock:
            taken, self.on_loop = self.on_loop, []
        return taken


def _has_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    config = EngineConfig.from_options(dtype="float32", threads=1, kv_cells=4096, parallel=4)
    engine = AsyncEngine(config)
    engine.start()
    try:
        assert engine.wait_ready(LOAD_TIMEOUT_S), f"the model did not load: {engine.load_error}"
        yield engine
    finally:
        asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def served(engine: AsyncEngine) -> Iterator[tuple[str, Checks]]:
    checks = Checks()
    check = engine.check_request

    def recorded(prompt_ids: list[int], params: SamplingParams) -> None:
        with checks.lock:
            checks.on_loop.append(_has_running_loop())
        check(prompt_ids, params)

    engine.check_request = recorded  # type: ignore[method-assign]
    try:
        with app_in_thread(build_app(engine, ServerConfig(), start_engine=False)) as url:
            yield url, checks
    finally:
        del engine.check_request  # the class's method again


def test_the_wrapper_tells_the_event_loop_from_a_worker() -> None:
    async def on_loop() -> tuple[bool, bool]:
        return _has_running_loop(), await asyncio.to_thread(_has_running_loop)

    assert asyncio.run(on_loop()) == (True, False)
    assert not _has_running_loop()


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
@pytest.mark.parametrize("path", list(BODIES))
def test_every_route_checks_its_prompts_off_the_event_loop(
    served: tuple[str, Checks], path: str, stream: bool
) -> None:
    url, checks = served
    checks.take()
    body = {**BODIES[path], "stream": stream}
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as client:
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        if stream:  # the stream ran to its end without an error event
            text = response.text
            assert "event: error" not in text and 'data: {"error"' not in text, text
            assert text.rstrip().endswith(("[DONE]", "}")), text
    prompts = len(body.get("prompt", [None]))
    # every prompt was checked (the completions body has two), none on the event loop
    assert checks.take() == [False] * prompts
