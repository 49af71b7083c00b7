"""``kvpark bench --scenario pressure`` with no ``--url``: the headline benchmark in one go,
parking against failing and against recompute-only.

    kvpark bench --scenario pressure --out bench-results     # -> bench-results/pressure.{json,png}
    kvpark bench --scenario pressure --chats 2 --kv-cells 256 --parallel 2 \\
        --prompt-tokens 40 --max-tokens 100 --aba-max-tokens 16   # a quick smoke run

For each N in ``--chats`` (4 and 8), three times in turn: start ``python -m kvpark serve`` on
127.0.0.1 with the pressure pool (``--kv-cells 1024 --parallel 4 --max-batch-tokens 256`` by
default) and ``--no-preempt``, then ``--preempt-ram 0`` (recompute only), then the default
flags; run the ``pressure`` scenario (N chats of ~``--prompt-tokens`` prompt tokens,
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
import time
from functools import partial
from typing import Any

from kvpark.bench.compare import payload
from kvpark.bench.machine import cpu_name, load_average, machine
from kvpark.bench.options import BenchOptions
from kvpark.bench.pressure import BASELINE, admitted_together, format_pressure_table
from kvpark.bench.pressure_goals import evaluate_goals, format_goals, write_pressure_plot
from kvpark.bench.report import format_table, write_json
from kvpark.bench.suites.arguments import checked_options, model_of, suite_parser
from kvpark.bench.suites.pressure_runs import (
    TEMPLATE_TOKENS,
    Runner,
    check_sizes,
    run_aba,
    run_pressure_levels,
)

SCENARIO = "pressure"
# The flags that size the run, recorded in the JSON's meta.sizes.
SIZE_FLAGS = (
    "chats", "kv_cells", "parallel", "page_size", "max_batch_tokens", "prompt_tokens",
    "max_tokens", "threads", "dtype", "aba_kv_cells", "aba_chats", "aba_requests",
    "aba_prompt_tokens", "aba_max_tokens",
)  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = suite_parser(SCENARIO, "Parking against failing and against recompute-only.", "pressure")
    p.add_argument("--chats", type=int, nargs="+", default=[4, 8], help="N chats per level")
    p.add_argument("--kv-cells", type=int, default=1024, help="the pressure pool, in cells")
    p.add_argument("--parallel", type=int, default=4, help="slots of the pressure server")
    p.add_argument("--page-size", type=int, default=16, help="cells per page")
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=350, help="approximate prompt length")
    p.add_argument("--max-tokens", type=int, default=300, help="tokens out per chat")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--serve-arg", action="append", default=[], help="extra kvpark serve flag")
    p.add_argument("--aba-kv-cells", type=int, default=4096, help="the no-pressure pool")
    p.add_argument("--aba-chats", type=int, default=4, help="the multi-chat A/B/A level")
    p.add_argument("--aba-requests", type=int, default=4, help="requests per A/B/A level")
    p.add_argument("--aba-prompt-tokens", type=int, default=64)
    p.add_argument("--aba-max-tokens", type=int, default=128)
    p.add_argument("--skip-aba", action="store_true", help="only the pressure levels")
    p.add_argument("--skip-pressure", action="store_true", help="only the A/B/A check")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds per server start")
    args = p.parse_args(argv)
    if min(args.chats) < 1 or args.parallel < 1 or args.aba_chats < 1:
        p.error("--chats, --parallel and --aba-chats must be positive")
    if not args.skip_pressure and (problem := check_sizes(args)):
        p.error(problem)
    for chats, requests in ((tuple(args.chats), None), ((1, args.aba_chats), args.aba_requests)):
        checked_options(p, partial(
            BenchOptions, concurrency=chats, requests_per_level=requests,
            prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, timeout_s=args.timeout,
        ))  # fmt: skip
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.model = model_of(args)
    load_now = load_average()
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
        "machine": machine(),
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
