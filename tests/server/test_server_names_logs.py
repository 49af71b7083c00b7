"""The names the served model answers to, and what the server logs.

A server with ``--served-model-name`` and a one-second stats line: the model answers to
``default``, its file name and the served name, an unknown name is a 404; /health polls and
/metrics scrapes are kept out of the access log, and a stats line is logged while requests run
and not when idle. In-process: the poll filter, the logging set-up and the stats line's text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import httpx
import pytest

from kvpark.engine.stats import EngineStats
from kvpark.server.run import PollFilter, configure_logging
from kvpark.server.stats_log import TokenCounts, is_active, stats_line
from support.servers import Server, serve_for_module

SERVED_NAME = "kvpark-test-model"
STATS_MARK = "kvpark.engine.stats: prompt throughput:"


def access_record(path: str) -> logging.LogRecord:
    """A record shaped as uvicorn's access logger makes one."""
    args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
    return logging.LogRecord(
        "uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None
    )


def test_the_poll_filter_drops_only_health_and_metrics() -> None:
    keep = PollFilter()
    assert not keep.filter(access_record("/health"))
    assert not keep.filter(access_record("/metrics?x=1"))
    assert keep.filter(access_record("/v1/models"))
    assert keep.filter(access_record("/healthz"))


def test_log_health_installs_no_filter_and_reconfiguring_stacks_none() -> None:
    root, access = logging.getLogger(), logging.getLogger("uvicorn.access")
    saved = (root.handlers[:], root.level, access.filters[:])
    try:
        configure_logging("text", "info")
        configure_logging("text", "info")
        assert sum(isinstance(f, PollFilter) for f in access.filters) == 1
        configure_logging("text", "info", log_health=True)
        assert not any(isinstance(f, PollFilter) for f in access.filters)
    finally:
        root.handlers[:], access.filters[:] = saved[0], saved[2]
        root.setLevel(saved[1])


def test_the_stats_line_reads_rates_queues_usage_and_preemptions() -> None:
    stats = EngineStats(
        requests_running=3,
        requests_waiting=1,
        requests_preempted=1,
        kv_cells_used=1536,
        kv_cells_total=4096,
        prompt_tokens_total=500,
        generated_tokens_total=120,
        preemptions_total={"swap": 3, "recompute": 1},
    )
    line = stats_line(stats, TokenCounts.read(stats, 12.0), TokenCounts(2.0, 100, 20))
    assert line == (
        "prompt throughput: 40.0 tok/s, generation throughput: 10.0 tok/s, running: 3, "
        "waiting: 1, parked: 1, KV cache usage: 37.5%, preemptions: 4 (swap 3, recompute 1)"
    )
    idle = EngineStats(prompt_tokens_total=500, generated_tokens_total=120)
    assert not is_active(idle, TokenCounts.read(idle, 0.0))
    assert is_active(idle, TokenCounts(0.0, 500, 119))  # a token since the last line
    assert is_active(stats, TokenCounts.read(stats, 0.0))  # requests in the engine


@pytest.fixture(scope="module")
def named_server() -> Iterator[Server]:
    yield from serve_for_module("--served-model-name", SERVED_NAME, "--log-stats-interval", "1")


def test_the_model_answers_to_default_its_file_name_and_the_served_name(
    named_server: Server,
) -> None:
    file_name = httpx.get(f"{named_server.base_url}/props").json()["model"]
    assert file_name.endswith(".gguf")
    with named_server.client() as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == SERVED_NAME
        for name in ("default", file_name, SERVED_NAME):
            chat = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            response = client.post("/v1/chat/completions", json=chat)
            assert response.status_code == 200, (name, response.text)
            assert response.json()["model"] == SERVED_NAME
            card = client.get(f"/v1/models/{name}")
            assert card.status_code == 200 and card.json()["id"] == SERVED_NAME


def test_an_unknown_model_name_is_a_404_json_error(named_server: Server) -> None:
    with named_server.client() as client:
        chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]}
        for response in (
            client.post("/v1/chat/completions", json=chat),
            client.get("/v1/models/gpt-4o"),
        ):
            assert response.status_code == 404
            error = response.json()["error"]
            assert "gpt-4o" in error["message"] and "'default'" in error["message"]
            assert error["param"] == "model"


def test_health_polls_and_metrics_scrapes_are_not_access_logged(named_server: Server) -> None:
    with named_server.client() as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
            assert client.get("/metrics").status_code == 200
        assert client.post("/tokenize", json={"content": "Hi"}).status_code == 200
    log = named_server.wait_for_log('"POST /tokenize HTTP/1.1" 200')
    assert "GET /health" not in log and "GET /metrics" not in log


def test_a_stats_line_is_logged_while_requests_run_and_not_when_idle(named_server: Server) -> None:
    before = named_server.log().count(STATS_MARK)
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
    with named_server.client() as client:
        assert client.post("/v1/completions", json=body).status_code == 200
    deadline = time.monotonic() + 30
    while named_server.log().count(STATS_MARK) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = [line for line in named_server.log().splitlines() if STATS_MARK in line]
    assert len(lines) > before, named_server.log()
    for part in ("generation throughput:", "running:", "waiting:", "parked:", "KV cache usage:"):
        assert part in lines[-1]
    assert "preemptions: 0 (swap 0, recompute 0)" in lines[-1]
    time.sleep(2.5)  # the line after the request's last tokens, then idle: no more lines
    idle_count = named_server.log().count(STATS_MARK)
    time.sleep(2.5)
    assert named_server.log().count(STATS_MARK) == idle_count
