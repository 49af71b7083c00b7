"""What exact mode costs: kvpark with ``--exact`` against kvpark without it, same workload, one run.

    .venv/bin/python bench/run_exact_cost.py            # -> bench-results/exact-cost.{json,png}

Starts ``python -m kvpark serve`` on 127.0.0.1 in normal mode, then with ``--exact`` (never both at
once: they would share the cores), runs the same seeded ``kvpark bench`` sweep against each
(``--concurrency``, 1, 4 and 8 chats by default), and writes every run with the exact/normal ratios
of aggregate tok/s per level. Goal: at least 0.9x at 8 chats (issue 12; issue 4 asked 0.8x on the
torch path). Server logs go to ``<out>/logs/``; the 1-minute load average before and after each
sweep is kept in the JSON.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpark.bench import BenchOptions, RunResult, Target, run
from kvpark.bench.compare import compare, format_comparison, payload
from kvpark.bench.report import format_table, write_json, write_plot
from peer_llamacpp import managed_server
from run_cpu_comparison import cpu_flags, cpu_name, default_model

NORMAL, EXACT = "kvpark normal", "kvpark exact"
GOAL_AT_8 = 0.9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--threads", type=int, default=2, help="kvpark --threads for both servers")
    p.add_argument("--kvpark-arg", action="append", default=[], help="extra kvpark serve flag")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--requests-per-level", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--name", default="exact-cost")
    args = p.parse_args()
    model = args.model or default_model()
    options = BenchOptions(
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        requests_per_level=args.requests_per_level, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, seed=args.seed, timeout_s=900.0,
    )  # fmt: skip
    base = [sys.executable, "-m", "kvpark", "serve", "--host", "127.0.0.1", "--port"]
    base += [str(args.port), "--model", model, "--threads", str(args.threads), *args.kvpark_arg]
    commands = {NORMAL: base, EXACT: [*base, "--exact"]}
    url = f"http://127.0.0.1:{args.port}"
    runs: list[RunResult] = []
    load: dict[str, list[float]] = {}
    for label, cmd in commands.items():
        print(f"== {label}: {' '.join(cmd)}", flush=True)
        log = args.out / "logs" / f"{label.replace(' ', '_')}.log"
        with managed_server(cmd, url + "/health", log, timeout_s=600.0):
            load[label] = [os.getloadavg()[0]]
            runs.extend(run([Target(url, label)], "sweep", options))
            load[label].append(os.getloadavg()[0])
    ratios = compare(runs, NORMAL)["ratios"].get(EXACT, {})
    at_8 = ratios.get("levels", {}).get("8", {}).get("aggregate_tok_s")
    goal = {"ratio_at_8": at_8, "target": GOAL_AT_8, "met": at_8 is not None and at_8 >= GOAL_AT_8}
    meta: dict[str, Any] = {
        "machine": {
            "cpu": cpu_name(),
            "flags": cpu_flags(),
            "cores": os.cpu_count(),
            "system": platform.platform(),
        },
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


if __name__ == "__main__":
    sys.exit(main())
