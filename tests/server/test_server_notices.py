"""Park notices end to end: a real server that parks every request every few tokens (test knob).

``KVPARK_PREEMPT_EVERY=3`` swaps each generating request out and back every 3 tokens, so every
stream carries ``: preempted`` / ``: resumed`` pairs while its data stays that of an unparked run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from support.metrics import parse_metrics
from support.servers import Server, serve_for_module
from support.sse import sse_data, sse_lines

PARK_EVERY = 3


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module(environ={"KVPARK_PREEMPT_EVERY": str(PARK_EVERY)})


def notices(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(": ") and line != ": preempt-keepalive"]


def test_every_park_is_announced_paired_and_changes_nothing(server: Server) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        lines = sse_lines(response)
    seen = notices(lines)
    assert len(seen) >= 2
    assert seen == [": preempted", ": resumed"] * (len(seen) // 2)
    chunks = sse_data(lines)
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[-1]["preempt"]["parks"] == len(seen) // 2
    whole = httpx.post(url, json=body, timeout=120).json()
    assert whole["choices"][0]["text"] == streamed
    assert whole["preempt"]["parks"] >= 1
    assert whole["usage"]["prompt_tokens"] == whole["timings"]["prompt_n"]
    server.wait_cells_free()


def test_every_notice_of_a_multi_prompt_stream_names_its_prompt(server: Server) -> None:
    body = {"prompt": ["Red", "Blue"], "max_tokens": 7, "ignore_eos": True, "stream": True}
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        seen = notices(sse_lines(response))
    assert seen and all(re.fullmatch(r": (preempted|resumed) [01]", n) for n in seen)
    for prompt in "01":
        mine = [n.split()[1] for n in seen if n.endswith(" " + prompt)]
        assert mine == ["preempted", "resumed"] * (len(mine) // 2) and mine
    server.wait_cells_free()


def test_metrics_count_the_parks(server: Server) -> None:
    samples = parse_metrics(httpx.get(f"{server.base_url}/metrics").text)
    assert 'kvpark_preemptions_total{mode="swap"}' in samples
    assert server.metric("kvpark_resumes_total") >= 1
    assert server.metric("kvpark_requests_preempted") == 0
