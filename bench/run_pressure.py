"""The headline benchmark in one go: parking against failing and against recompute-only (SPEC §7).

    .venv/bin/python bench/run_pressure.py                  # -> bench-results/pressure.{json,png}
    .venv/bin/python bench/run_pressure.py --chats 2 --kv-cells 256 --parallel 2 \\
        --prompt-tokens 40 --max-tokens 100 --aba-max-tokens 16   # a quick smoke run

For each N in ``--chats`` (4 and 8), three times in turn: start ``python -m kvpark serve`` on
127.0.0.1 with the pressure pool (``--kv-cells 1024 --parallel 4 --max-batch-tokens 256`` by
default) and ``--no-preempt``, then ``--preempt-ram 0`` (recompute only), then the default
flags; run ``kvpark bench --scenario pressure`` (N chats of ~``--prompt-tokens`` prompt tokens,
``--max-tokens`` out, ``ignore_eos``, sent at once) against it; stop it. Each chat fits the pool
alone but N of them (or ``--parallel`` of them) do not fit together; the script checks this
before it starts and, from the prompt lengths the server counted, after each level.

Then the A/B/A no-pressure check: a big pool (``--aba-kv-cells``), the default flags (A), then
``--no-preempt`` (B), then the default again (A), each measuring single-stream decode tok/s
(``--aba-requests`` chats one at a time) and ``--aba-chats``-chat decode tok/s; the ratio is the
mean of the two A runs over B, and the A-A spread says how much of it is noise.

Writes ``<out>/<name>.json`` (every run, every request, the goals, the A/B/A, the commands, the
load average) and ``<out>/<name>.png``, prints the table and whether each goal is met. Server logs
go to ``<out>/logs/``. Measure on a quiet machine (see docs/benchmarks.md): the load average is
printed before and after each server and kept in the JSON.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpark.bench import BenchOptions, RunResult, Target, run
from kvpark.bench.compare import payload
from kvpark.bench.pressure import BASELINE, MODES, admitted_together, format_pressure_table
from kvpark.bench.pressure_goals import (
    aba_summary,
    evaluate_goals,
    format_goals,
    write_pressure_plot,
)
from kvpark.bench.report import format_table, write_json
from peer_llamacpp import managed_server
from run_cpu_comparison import cpu_name, default_model

# The chat template around a prompt of ``--prompt-tokens`` costs about this many tokens more
# (SmolLM2's default system prompt); used only to check the sizes before anything starts.
TEMPLATE_TOKENS = 30
# The flags that size the run, recorded in the JSON's meta.sizes.
SIZE_FLAGS = (
    "chats", "kv_cells", "parallel", "page_size", "max_batch_tokens", "prompt_tokens",
    "max_tokens", "threads", "dtype", "aba_kv_cells", "aba_chats", "aba_requests",
    "aba_prompt_tokens", "aba_max_tokens",
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_command(
    args: argparse.Namespace, port: int, pool: list[str], mode: list[str]
) -> list[str]:
    cmd = [sys.executable, "-m", "kvpark", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model", args.model, "--threads", str(args.threads), "--dtype", args.dtype]
    return cmd + pool + list(args.serve_arg) + mode


def pressure_pool(args: argparse.Namespace) -> list[str]:
    return [
        "--kv-cells", str(args.kv_cells), "--parallel", str(args.parallel),
        "--page-size", str(args.page_size), "--max-batch-tokens", str(args.max_batch_tokens),
    ]  # fmt: skip


def aba_pool(args: argparse.Namespace) -> list[str]:
    return [
        "--kv-cells", str(args.aba_kv_cells), "--parallel", str(max(args.aba_chats, 1)),
        "--max-batch-tokens", str(args.max_batch_tokens),
    ]  # fmt: skip


def check_sizes(args: argparse.Namespace) -> str | None:
    """Why the sizes cannot give "each fits alone, not together", or None when they can."""
    prompt = args.prompt_tokens + TEMPLATE_TOKENS
    per_chat = prompt + args.max_tokens
    if per_chat > args.kv_cells:
        return f"a chat needs ~{per_chat} cells: more than the pool ({args.kv_cells}) alone"
    for chats in args.chats:
        at_once = min(chats, args.parallel)
        if at_once * per_chat <= args.kv_cells:
            return (
                f"{chats} chats of ~{per_chat} cells ({at_once} at once) fit the pool of "
                f"{args.kv_cells} together: no pressure"
            )
        if admitted_together(prompt, at_once, args.kv_cells, args.page_size) < 2:
            return (
                f"prompts of ~{prompt} tokens are admitted one at a time into a pool of "
                f"{args.kv_cells} cells: the chats would never press on each other"
            )
    return None


def merge(label: str, parts: list[RunResult]) -> RunResult:
    """One run per mode: the levels of its servers (one per N), in order."""
    first = parts[0]
    merged = RunResult(label, first.url, first.model, first.scenario, dict(first.options))
    merged.options["concurrency"] = [lv.concurrency for part in parts for lv in part.levels]
    merged.extra = {"pressure": [], "fit": {}, "props": first.extra.get("props")}
    for part in parts:
        merged.levels.extend(part.levels)
        merged.requests.update(part.requests)
        merged.extra["pressure"].extend(part.extra.get("pressure", []))
        merged.extra["fit"].update(part.extra.get("fit", {}))
    return merged


class Runner:
    """Starts one server at a time, runs one scenario against it, stops it; keeps the record."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.commands: dict[str, list[str]] = {}
        self.load: dict[str, list[float]] = {}  # 1-minute load average before and after

    def measure(
        self, key: str, label: str, cmd_pool: list[str], mode: list[str], scenario: str,
        options: BenchOptions,
    ) -> RunResult:  # fmt: skip
        port = free_port()
        cmd = serve_command(self.args, port, cmd_pool, mode)
        self.commands[key] = cmd
        url = f"http://127.0.0.1:{port}"
        log = self.args.out / "logs" / f"{key}.log"
        print(f"== {key}: {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        with managed_server(cmd, url + "/health", log, timeout_s=self.args.startup_timeout):
            self.load[key] = [os.getloadavg()[0]]
            result = run([Target(url, label)], scenario, options)[0]
            self.load[key].append(os.getloadavg()[0])
        print(
            f"   {time.monotonic() - started:.0f} s; load average {self.load[key][0]:.2f} -> "
            f"{self.load[key][1]:.2f}",
            flush=True,
        )
        return result


def run_pressure_levels(args: argparse.Namespace, runner: Runner) -> list[RunResult]:
    parts: dict[str, list[RunResult]] = {label: [] for label, _ in MODES}
    for chats in args.chats:
        options = BenchOptions(
            concurrency=(chats,), prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
            seed=args.seed, timeout_s=args.timeout, warmup=1,
        )  # fmt: skip
        for label, flags in MODES:
            key = f"pressure-{chats}-{label}"
            result = runner.measure(
                key, label, pressure_pool(args), list(flags), "pressure", options
            )
            parts[label].append(result)
    return [merge(label, runs) for label, runs in parts.items() if runs]


def run_aba(args: argparse.Namespace, runner: Runner) -> tuple[list[RunResult], dict[str, Any]]:
    options = BenchOptions(
        concurrency=(1, args.aba_chats), requests_per_level=args.aba_requests,
        prompt_tokens=args.aba_prompt_tokens, max_tokens=args.aba_max_tokens, seed=args.seed,
        timeout_s=args.timeout, warmup=1,
    )  # fmt: skip
    runs = []
    for label, flags in (
        ("A1 default", []),
        ("B no-preempt", ["--no-preempt"]),
        ("A2 default", []),
    ):
        key = "aba-" + label.split()[0]
        runs.append(runner.measure(key, label, aba_pool(args), flags, "sweep", options))
    return runs, aba_summary(runs[0], runs[1], runs[2], args.aba_chats)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--chats", type=int, nargs="+", default=[4, 8], help="N chats per level")
    p.add_argument("--kv-cells", type=int, default=1024, help="the pressure pool, in cells")
    p.add_argument("--parallel", type=int, default=4, help="slots of the pressure server")
    p.add_argument("--page-size", type=int, default=16, help="cells per page")
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=350, help="approximate prompt length")
    p.add_argument("--max-tokens", type=int, default=300, help="tokens out per chat")
    p.add_argument("--threads", type=int, default=2, help="kvpark serve --threads")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--serve-arg", action="append", default=[], help="extra kvpark serve flag")
    p.add_argument("--aba-kv-cells", type=int, default=4096, help="the no-pressure pool")
    p.add_argument("--aba-chats", type=int, default=4, help="the multi-chat A/B/A level")
    p.add_argument("--aba-requests", type=int, default=4, help="requests per A/B/A level")
    p.add_argument("--aba-prompt-tokens", type=int, default=64)
    p.add_argument("--aba-max-tokens", type=int, default=128)
    p.add_argument("--skip-aba", action="store_true", help="only the pressure levels")
    p.add_argument("--skip-pressure", action="store_true", help="only the A/B/A check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds per server start")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--name", default="pressure")
    args = p.parse_args(argv)
    if min(args.chats) < 1 or args.parallel < 1 or args.aba_chats < 1:
        p.error("--chats, --parallel and --aba-chats must be positive")
    if not args.skip_pressure and (problem := check_sizes(args)):
        p.error(problem)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.model = args.model or default_model()
    load_now = os.getloadavg()[0]
    if load_now > 1.0:
        print(f"warning: load average {load_now:.2f}: the figures will show contention", flush=True)
    if not args.skip_pressure:
        prompt = args.prompt_tokens + TEMPLATE_TOKENS
        admitted = admitted_together(prompt, args.parallel, args.kv_cells, args.page_size)
        print(
            f"pressure: {' and '.join(map(str, args.chats))} chats of ~{prompt} prompt tokens "
            f"(chat template included) + {args.max_tokens} out = ~{prompt + args.max_tokens} "
            f"cells each, in {args.kv_cells} cells / {args.parallel} slots ({admitted} prompts "
            "admitted at once)",
            flush=True,
        )
    started = time.monotonic()
    runner = Runner(args)
    runs = [] if args.skip_pressure else run_pressure_levels(args, runner)
    aba_runs, aba = ([], None) if args.skip_aba else run_aba(args, runner)
    goals = evaluate_goals(runs, aba)
    meta: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "system": platform.platform()},
        "model_file": args.model,
        "sizes": {name: getattr(args, name) for name in SIZE_FLAGS},
        "commands": runner.commands,
        "load_average_1m": runner.load,
        "total_s": round(time.monotonic() - started, 1),
    }
    extra: dict[str, Any] = {"meta": meta, "goals": goals}
    if aba is not None:
        extra["aba"] = {**aba, "runs": [r.to_json() for r in aba_runs]}
    doc = payload(runs, BASELINE if any(r.label == BASELINE for r in runs) else None, extra)
    if not runs:
        doc.pop("comparison", None)
    path = write_json(args.out / f"{args.name}.json", doc)
    title = (
        f"kvpark pressure: {args.kv_cells} cells, {args.parallel} slots, "
        f"~{args.prompt_tokens} + {args.max_tokens} tokens per chat ({cpu_name()})"
    )
    plot = write_pressure_plot(args.out / f"{args.name}.png", runs, aba, title)
    if runs:
        print(format_pressure_table(runs))
    if aba_runs:
        print(format_table(aba_runs))
        for key, part in aba.items() if aba else ():
            if isinstance(part, dict) and "ratio" in part:
                print(
                    f"A/B/A {key}: decode tok/s A1/B/A2 {_show(part['decode_tok_s'])}, "
                    f"ratio {_num(part['ratio'])}, A-A spread {_num(part['a_spread'])}"
                )
    print(format_goals(goals))
    print(f"total {meta['total_s']:.0f} s; wrote {path} and {plot}")
    return 0


def _num(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"


def _show(values: list[float | None]) -> str:
    return " / ".join("-" if v is None else f"{v:.1f}" for v in values)


if __name__ == "__main__":
    sys.exit(main())
