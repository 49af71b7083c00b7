"""``kvpark serve --tensor-parallel 2`` on two gloo ranks on 127.0.0.1, over a tiny Llama whose
heads divide (support/tiny_tp.py), started both ways:

- ``spawned``: kvpark starts rank 1 itself; normal mode; ``KVPARK_PREEMPT_EVERY`` parks every
  generating request every 3 tokens, by swap: each rank's share of the cells goes to its own
  host memory and back.
- ``torchrun``: two ``kvpark serve`` processes with torchrun's variables (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): rank 0 serves, rank 1 runs the worker loop;
  exact mode; the same forced parks, but ``KVPARK_TP_FAIL_SAVE=1`` makes rank 1 fail every save,
  so every park turns into a recompute on both ranks.

Greedy texts are the one-rank torch runner's (in this process, no parks). Then rank 1 fails: the
spawned worker is killed (its sockets close: the step fails at once), torchrun's rank 1 is
stopped (it hangs: the step's collective fails at ``KVPARK_TP_TIMEOUT``, here 5 s); either way
the stream in flight ends with an error naming the tensor-parallel group and the server exits 1
instead of hanging; a hung rank that wakes up finds rank 0 gone and exits too.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

import kvpark
from support.servers import Server, free_port, launch_server, stop_server, wait_healthy
from support.sse import sse_data
from support.tiny_tp import FLAGS, save_tiny_tp

PROMPTS = [[5, 17, 44, 3, 90, 61, 12, 8, 77, 29, 30, 2], [101, 7, 7, 250, 3000, 41, 9, 12, 600]]
NEW = 16
PARK_EVERY = "3"
EXIT_TIMEOUT_S = 30.0
TP_TIMEOUT = "5"  # torchrun's ranks: a collective fails after 5 s without the other rank
RANK_1 = {"RANK": "1", "LOCAL_RANK": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_tp(tmp_path_factory.mktemp("tiny-tp"))


@pytest.fixture(scope="module")
def servers(model_dir: str) -> Iterator[dict[str, Server]]:
    flags = (*FLAGS, "--tensor-parallel", "2", "--model", model_dir)
    torchrun = {
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "KVPARK_TP_TIMEOUT": TP_TIMEOUT,
    }
    parks = {"KVPARK_PREEMPT_EVERY": PARK_EVERY}
    launched = {
        "spawned": launch_server(*flags, environ=parks),
        "torchrun": launch_server(
            *flags, "--exact", environ={**parks, **torchrun, "RANK": "0", "LOCAL_RANK": "0"}
        ),
        "rank 1": launch_server(  # its saves fail: every park becomes a recompute everywhere
            *flags, "--exact", environ={**parks, **torchrun, **RANK_1, "KVPARK_TP_FAIL_SAVE": "1"}
        ),
    }
    try:
        wait_healthy(launched["spawned"])
        wait_healthy(launched["torchrun"])
        yield launched
    finally:
        stop_server(*launched.values())


@pytest.fixture(scope="module")
def one_rank(model_dir: str) -> list[str]:
    """The greedy texts of the one-rank torch runner, no parks."""
    llm = kvpark.LLM(
        model_dir, runner="torch", weights="dense", dtype="float32", kv_dtype="float32",
        threads=1, kv_cells=1024,
    )  # fmt: skip
    params = kvpark.SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return [out.text for out in llm.generate(PROMPTS, params)]


def _complete(server: Server, prompt: list[int], out: dict[int, Any], i: int) -> None:
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    with server.client() as client:
        out[i] = client.post("/v1/completions", json=body).json()


@pytest.mark.parametrize(("name", "mode"), [("spawned", "swap"), ("torchrun", "recompute")])
def test_forced_parks_leave_greedy_tokens_those_of_one_rank(
    servers: dict[str, Server], one_rank: list[str], name: str, mode: str
) -> None:
    server = servers[name]
    out: dict[int, Any] = {}
    threads = [
        threading.Thread(target=_complete, args=(server, p, out, i)) for i, p in enumerate(PROMPTS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    texts = [out[i]["choices"][0]["text"] for i in range(len(PROMPTS))]
    assert texts == one_rank
    assert all(out[i]["preempt"]["parks"] >= NEW // int(PARK_EVERY) - 1 for i in out)
    metrics = server.metrics()
    other = "recompute" if mode == "swap" else "swap"
    assert metrics[f'kvpark_preemptions_total{{mode="{mode}"}}'] >= len(PROMPTS) * 3
    assert metrics[f'kvpark_preemptions_total{{mode="{other}"}}'] == 0
    with server.client() as client:
        props = client.get("/props").json()
    assert props["tensor_parallel"] == 2 and props["exact"] == (name == "torchrun")


def _rank_1(servers: dict[str, Server], name: str) -> psutil.Process:
    if name == "torchrun":
        return psutil.Process(servers["rank 1"].process.pid)
    (worker,) = [
        p
        for p in psutil.Process(servers[name].process.pid).children()
        if "kvpark.runner.tp_worker" in " ".join(p.cmdline())
    ]
    return worker


@pytest.mark.parametrize(("name", "how"), [("spawned", "killed"), ("torchrun", "stopped")])
def test_a_rank_that_dies_or_hangs_fails_the_requests_and_the_server_exits_1(
    servers: dict[str, Server], name: str, how: str
) -> None:
    server = servers[name]
    rank_1 = _rank_1(servers, name)
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with server.client() as client, client.stream("POST", "/v1/completions", json=body) as got:
        lines = got.iter_lines()
        seen = [next(line for line in lines if line.startswith("data: "))]
        if how == "killed":
            rank_1.kill()
        else:
            rank_1.suspend()
        seen += [line for line in lines if line]
    error = sse_data(seen)[-1]["error"]
    assert error["code"] == 500
    assert "the runner failed" in error["message"] and "tensor-parallel" in error["message"]
    try:
        code = server.process.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after rank 1 was {how}:\n{server.log()}") from None
    assert code == 1, server.log()
    assert "exiting with status 1" in server.log()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.base_url}/health", timeout=2)
    if how == "stopped":
        rank_1.resume()  # rank 0 is gone: its next command never comes, its store is closed
        assert rank_1.wait(EXIT_TIMEOUT_S) == 1
