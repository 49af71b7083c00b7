"""``kvpark bench --scenario serving-overhead``: what the serving path costs, one workload
in-process, then through the HTTP server, in one run.

    kvpark bench --scenario serving-overhead --repeats 2 --out bench-results   # -> serving.json

In-process, the engine alone runs the workload the sweep sends
(``kvpark.bench.in_process.serving`` in a subprocess: the bench client imports no engine); then
``kvpark serve`` with the same flags runs the same seeded sweep over HTTP (engine thread,
asyncio, SSE, the bench client on the same cores). Both count generated tokens over the wall
time of the level. Goal: the server keeps at least 90 % of in-process aggregate tok/s at 8
chats. ``--repeats`` alternates the two and reports medians (the VM moves ~15 % between runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

from kvpark.bench.client import Target
from kvpark.bench.compare import run
from kvpark.bench.machine import machine
from kvpark.bench.options import BenchOptions
from kvpark.bench.report import pyplot
from kvpark.bench.servers import kvpark_serve_command, managed_server
from kvpark.bench.suites.arguments import checked_options, model_of, suite_parser
from kvpark.bench.suites.in_process import module_command

SCENARIO = "serving-overhead"
MODULE = "serving"
GOAL = 0.9


def write_plot(path: Path, figures: dict[str, list[float]], title: str) -> None:
    """Bars of every repeat's aggregate tok/s, in-process beside the server."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    repeats = range(len(figures["in_process"]))
    for shift, (label, values) in zip((-0.2, 0.2), figures.items(), strict=True):
        ax.bar([r + shift for r in repeats], values, width=0.4, label=label.replace("_", "-"))
    ax.set(xlabel="repeat", ylabel="aggregate tok/s", title=title, xticks=list(repeats))
    ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def in_process_command(args: argparse.Namespace, tag: str) -> list[str]:
    return module_command(MODULE, [
        "--model", args.model, "--threads", str(args.threads),
        "--concurrency", str(args.concurrency), "--requests", str(args.requests),
        "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
        "--seed", str(args.seed), "--tag", tag,
    ])  # fmt: skip


def in_process_tok_s(cmd: list[str]) -> float:
    """The ``tok_s`` of the script's last line of output."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["tok_s"])


def build_parser() -> argparse.ArgumentParser:
    p = suite_parser(SCENARIO, "The engine alone, then through kvpark serve.", "serving")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=16, help="requests per level")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--port", type=int, default=8126)
    p.add_argument("--kvpark-arg", action="append", default=[], help="extra kvpark serve flag")
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.model = model_of(args)
    options = checked_options(p, lambda: BenchOptions(
        concurrency=(args.concurrency,), requests_per_level=args.requests,
        prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, seed=args.seed,
        timeout_s=900.0,
    ))  # fmt: skip
    flags = ["--threads", str(args.threads), *args.kvpark_arg]
    cmd = kvpark_serve_command(args.model, args.port, *flags)
    url = f"http://127.0.0.1:{args.port}"
    figures: dict[str, list[float]] = {"in_process": [], "server": []}
    for repeat in range(args.repeats):
        figures["in_process"].append(in_process_tok_s(in_process_command(args, f"r{repeat}")))
        log = args.out / "logs" / f"serving-{repeat}.log"
        with managed_server(cmd, url + "/health", log, timeout_s=600.0):
            result = run([Target(url, "kvpark server")], "sweep", options)[0]
        figures["server"].append(result.levels[0].aggregate_tok_s)
        print(f"repeat {repeat}: in-process {figures['in_process'][-1]:.1f} tok/s, "
              f"server {figures['server'][-1]:.1f} tok/s", flush=True)  # fmt: skip
    medians = {k: statistics.median(v) for k, v in figures.items()}
    ratio = medians["server"] / medians["in_process"]
    doc: dict[str, Any] = {
        "machine": machine(), "model_file": args.model, "command": cmd,
        "concurrency": args.concurrency, "requests": args.requests,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "tok_s": figures,
        "median_tok_s": medians, "server_over_in_process": ratio,
        "goal": {"target": GOAL, "met": ratio >= GOAL},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=2))
    write_plot(args.out / f"{args.name}.png", figures, f"serving path at {args.concurrency} chats")
    print(f"median: in-process {medians['in_process']:.1f}, server {medians['server']:.1f} tok/s:"
          f" {ratio:.2f}x (goal {GOAL}x)")  # fmt: skip
    return 0
