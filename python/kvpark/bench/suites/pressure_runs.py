"""The pressure suite's servers, one at a time: the three parking modes per N chats, and the
A/B/A no-pressure check; with the size check that refuses a run that cannot press.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvpark.bench.client import Target
from kvpark.bench.compare import run
from kvpark.bench.machine import free_port, load_average
from kvpark.bench.options import BenchOptions
from kvpark.bench.pressure import MODES, admitted_together
from kvpark.bench.pressure_goals import aba_summary
from kvpark.bench.report import RunResult
from kvpark.bench.servers import kvpark_serve_command, managed_server

# The chat template around a prompt of ``--prompt-tokens`` costs about this many tokens more
# (SmolLM2's default system prompt); used only to check the sizes before anything starts.
TEMPLATE_TOKENS = 30


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

    def serve_command(self, port: int, pool: list[str], mode: list[str]) -> list[str]:
        flags = ["--threads", str(self.args.threads), "--dtype", self.args.dtype]
        return kvpark_serve_command(
            self.args.model, port, *flags, *pool, *self.args.serve_arg, *mode
        )

    def measure(
        self, key: str, label: str, cmd_pool: list[str], mode: list[str], scenario: str,
        options: BenchOptions,
    ) -> RunResult:  # fmt: skip
        port = free_port()
        cmd = self.serve_command(port, cmd_pool, mode)
        self.commands[key] = cmd
        url = f"http://127.0.0.1:{port}"
        log = self.args.out / "logs" / f"{key}.log"
        print(f"== {key}: {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        with managed_server(cmd, url + "/health", log, timeout_s=self.args.startup_timeout):
            self.load[key] = [load_average()]
            result = run([Target(url, label)], scenario, options)[0]
            self.load[key].append(load_average())
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
