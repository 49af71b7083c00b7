"""``kvpark bench --scenario cpu-comparison``: kvpark against llama.cpp's llama-server on this
CPU, one run: the comparison figures of docs/benchmarks.md.

Starts each server in turn on 127.0.0.1 (never two at once: they would share the cores) with the
same GGUF, threads, slots and KV capacity (``--kv-cells N`` for kvpark, ``-c N`` for
llama-server), runs the same seeded sweep against it while sampling its process tree's resident
memory (``peak_rss``), stops it, and writes ``<out>/<name>.json``, ``.png`` and ``.md`` (the
table lines for docs/benchmarks.md). llama-server is the baseline of every ratio; llama-cpp-python
(one request at a time) is measured too when its venv exists, and skipped with a line otherwise
(unless ``--peer`` names it). The targets are judged kvpark / llama-server and printed as MET /
NOT MET: single-stream decode >= 1.0x (stretch 1.3x), aggregate at 8 chats >= 2.0x (stretch 3x),
peak resident memory <= 2x at the same KV capacity. Server logs go to ``<out>/logs/``. The
servers' commands and their measuring are ``measured.py``'s, shared with ``quant-types``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from kvpark.bench.client import Target
from kvpark.bench.compare import compare, format_comparison, payload, run
from kvpark.bench.cpu_targets import OURS, format_goals, judge, markdown_rows
from kvpark.bench.machine import cpu_name, kvpark_source, load_average, machine
from kvpark.bench.options import BenchOptions
from kvpark.bench.peers import DEFAULT_PEER_PYTHON, llama_server_version, peer_version
from kvpark.bench.report import RunResult, format_table, write_json, write_plot
from kvpark.bench.suites.arguments import (
    add_peer_flags,
    checked_options,
    llama_server_binary,
    model_of,
    parse_peers,
    suite_parser,
)
from kvpark.bench.suites.measured import available, commands, measured_server

SCENARIO = "cpu-comparison"
DEFAULT_PEERS = "llama-server,llama-cpp-python"
BASELINE = "llama-server"


def build_parser() -> argparse.ArgumentParser:
    p = suite_parser(SCENARIO, "kvpark against llama.cpp's llama-server on this CPU.", SCENARIO)
    add_peer_flags(p, DEFAULT_PEERS)
    p.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON, help="llama-cpp-python's venv")
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
    return p


def measure(
    planned: dict[str, tuple[list[str], str]], options: BenchOptions, args: argparse.Namespace
) -> tuple[list[RunResult], dict[str, float], dict[str, list[float]]]:
    """One sweep per server, one server at a time: the runs, peak MiB and load averages."""
    runs: list[RunResult] = []
    memory: dict[str, float] = {}  # peak MiB of each server's process tree
    load: dict[str, list[float]] = {}  # 1-minute load average before and after each sweep
    url = f"http://127.0.0.1:{args.port}"
    for label, (cmd, ready) in planned.items():
        print(f"== {label}: {' '.join(cmd)}", flush=True)
        with measured_server(cmd, url, ready, args.out / "logs" / f"{label}.log") as measured:
            (result,) = run([Target(url, label)], "sweep", options)
        result.extra["props"] = measured.props
        assert measured.peak is not None
        result.extra["peak_memory"] = measured.peak.to_json()
        memory[label], load[label] = measured.peak_mib, measured.load
        runs.append(result)
    return runs, memory, load


def main(argv: list[str]) -> int:
    started, load_at_start = time.monotonic(), load_average()
    p = build_parser()
    args = p.parse_args(argv)
    try:
        peers = parse_peers(args.peer or DEFAULT_PEERS)
    except ValueError as exc:
        p.error(str(exc))
    args.llama_server = llama_server_binary(args) if "llama-server" in peers else args.llama_server
    found = available(
        args.llama_server or Path(), args.peer_python, [*peers, OURS], asked=args.peer is not None
    )
    if isinstance(found, int):
        return found
    args.model = model_of(args)
    options = checked_options(p, lambda: BenchOptions(
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        requests_per_level=args.requests_per_level, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, seed=args.seed, timeout_s=600.0,
    ))  # fmt: skip
    planned = commands(args, found)
    runs, memory, load = measure(planned, options, args)
    baseline = BASELINE if BASELINE in planned else runs[0].label
    meta: dict[str, Any] = {
        "machine": machine(),
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
    write_json(args.out / f"{args.name}.json", payload(runs, baseline, {"meta": meta}))
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
