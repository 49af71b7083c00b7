"""``kvpark bench --scenario exact-cost``: what exact mode costs, kvpark with ``--exact`` against
kvpark without it, same workload, one run.

    kvpark bench --scenario exact-cost --out bench-results   # -> exact-cost.{json,png} there

Starts ``python -m kvpark serve`` on 127.0.0.1 in normal mode, then with ``--exact`` (never both
at once: they would share the cores), runs the same seeded sweep against each (``--concurrency``,
1, 4 and 8 chats by default), and writes every run with the exact/normal ratios of aggregate
tok/s per level. Goal: at least 0.9x at 8 chats. Server logs go to ``<out>/logs/``; the 1-minute
load average before and after each sweep is kept in the JSON.
"""

from __future__ import annotations

from typing import Any

from kvpark.bench.client import Target
from kvpark.bench.compare import compare, format_comparison, payload, run
from kvpark.bench.machine import cpu_name, load_average, machine
from kvpark.bench.options import BenchOptions
from kvpark.bench.report import RunResult, format_table, write_json, write_plot
from kvpark.bench.servers import kvpark_serve_command, managed_server
from kvpark.bench.suites.arguments import checked_options, model_of, suite_parser

SCENARIO = "exact-cost"
NORMAL, EXACT = "kvpark normal", "kvpark exact"
GOAL_AT_8 = 0.9


def main(argv: list[str]) -> int:
    p = suite_parser(SCENARIO, "kvpark --exact against normal mode, one run.", SCENARIO)
    p.add_argument("--kvpark-arg", action="append", default=[], help="extra kvpark serve flag")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--requests-per-level", type=int, default=None)
    args = p.parse_args(argv)
    model = model_of(args)
    options = checked_options(p, lambda: BenchOptions(
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        requests_per_level=args.requests_per_level, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, seed=args.seed, timeout_s=900.0,
    ))  # fmt: skip
    base = kvpark_serve_command(model, args.port, "--threads", str(args.threads), *args.kvpark_arg)
    commands = {NORMAL: base, EXACT: [*base, "--exact"]}
    url = f"http://127.0.0.1:{args.port}"
    runs: list[RunResult] = []
    load: dict[str, list[float]] = {}
    for label, cmd in commands.items():
        print(f"== {label}: {' '.join(cmd)}", flush=True)
        log = args.out / "logs" / f"{label.replace(' ', '_')}.log"
        with managed_server(cmd, url + "/health", log, timeout_s=600.0):
            load[label] = [load_average()]
            runs.extend(run([Target(url, label)], "sweep", options))
            load[label].append(load_average())
    ratios = compare(runs, NORMAL)["ratios"].get(EXACT, {})
    at_8 = ratios.get("levels", {}).get("8", {}).get("aggregate_tok_s")
    goal = {"ratio_at_8": at_8, "target": GOAL_AT_8, "met": at_8 is not None and at_8 >= GOAL_AT_8}
    meta: dict[str, Any] = {
        "machine": machine(),
        "model_file": model,
        "load_average_1m": load,
        "commands": commands,
        "goal": goal,
    }
    doc = payload(runs, NORMAL, {"meta": meta})
    write_json(args.out / f"{args.name}.json", doc)
    write_plot(args.out / f"{args.name}.png", runs, f"kvpark exact vs normal mode ({cpu_name()})")
    print(format_table(runs))
    if "comparison" in doc:
        print(format_comparison(doc["comparison"]))
    print("goal:", goal)
    print(f"wrote {args.out / args.name}.json and .png")
    return 0
