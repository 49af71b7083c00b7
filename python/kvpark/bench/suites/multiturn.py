"""``kvpark bench --scenario multiturn`` with no ``--url``: conversations that come back, one
run: kvpark with and without its prefix cache against llama.cpp's llama-server.

    kvpark bench --scenario multiturn --peer llama-server --out bench-results   # 8 x 6 turns
    kvpark bench --scenario multiturn --kv-cells 2400 --pressure --name multiturn-pressure

Starts each server in turn on 127.0.0.1 (never two at once) with the same GGUF, threads, slots
and KV capacity, runs the seeded ``multiturn`` scenario against it (N conversations of T turns, a
~300-token system prompt shared by all, each turn the history with the server's own answers plus
a new user message), stops it, and writes ``<out>/<name>.json`` and ``.png``. llama-server runs
with its prompt cache on (``cache_prompt``, its default per request, and ``--cache-reuse 256``)
and ``-np`` slots; it is skipped with a line when it is not built (``kvpark bench
build-llama-server``, or ``--build-peer``) unless ``--peer`` names it. The targets, printed as
MET / NOT MET: with the cache, median TTFT of turns 3-6 at most 0.3x kvpark's own without it;
ahead of llama-server on that median and on the workload's wall time; under pressure, every
conversation completes and the cache serves at least 50 % of the prompt tokens.
"""

from __future__ import annotations

from typing import Any

from kvpark.bench.client import Target
from kvpark.bench.compare import payload, run
from kvpark.bench.machine import cpu_name, machine
from kvpark.bench.options import BenchOptions
from kvpark.bench.peers import llama_server_command
from kvpark.bench.report import RunResult, write_json, write_plot
from kvpark.bench.servers import kvpark_serve_command, managed_server
from kvpark.bench.suites.arguments import (
    add_peer_flags,
    checked_options,
    llama_server_binary,
    model_of,
    parse_peers,
    suite_parser,
)

SCENARIO = "multiturn"


def targets(runs: dict[str, dict[str, Any]], pressure: bool) -> list[str]:
    """The issue's goals over the per-server summaries, one line each."""
    lines = []

    def goal(text: str, ok: bool | None) -> None:
        lines.append(f"{text}: {'n/a' if ok is None else 'MET' if ok else 'NOT MET'}")

    on, off, peer = (runs.get(k) for k in ("kvpark", "kvpark-no-cache", "llama-server"))
    late = "ttft_p50_turns_3_on_s"
    if on and off and on[late] and off[late]:
        goal(f"TTFT turns 3+ with the cache {on[late] / off[late]:.2f}x without (<= 0.3x)",
             on[late] <= 0.3 * off[late])  # fmt: skip
    if on and peer and on[late] and peer[late]:
        goal(f"TTFT turns 3+ {on[late] / peer[late]:.2f}x llama-server's (< 1x)",
             on[late] < peer[late])  # fmt: skip
        goal(f"wall time {on['wall_s'] / peer['wall_s']:.2f}x llama-server's (< 1x)",
             on["wall_s"] < peer["wall_s"])  # fmt: skip
    if pressure and on:
        goal("every conversation completes", on["completed"])
        share = on["cache_share"] or 0.0
        goal(f"the cache serves {share:.0%} of prompt tokens (>= 50 %)", share >= 0.5)
    return lines


def main(argv: list[str]) -> int:
    p = suite_parser(
        SCENARIO, "kvpark with and without its prefix cache, and llama-server.", SCENARIO
    )
    add_peer_flags(p, "llama-server")
    p.add_argument("--parallel", type=int, default=8, help="slots (llama-server -np)")
    p.add_argument("--kv-cells", type=int, default=8192, help="KV capacity (llama-server -c)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=32, help="tokens out per turn")
    p.add_argument("--pressure", action="store_true", help="judge the pressure goals too")
    p.add_argument("--port", type=int, default=8124)
    args = p.parse_args(argv)
    try:
        peers = parse_peers(args.peer or "llama-server")
    except ValueError as exc:
        p.error(str(exc))
    if "llama-cpp-python" in peers:
        p.error(
            "multiturn measures llama-server alone as its peer (one request at a time would "
            "not be a multi-chat figure)"
        )
    model = model_of(args)
    url = f"http://127.0.0.1:{args.port}"
    options = checked_options(p, lambda: BenchOptions(
        concurrency=(args.conversations,), prompt_tokens=args.system_tokens,
        max_tokens=args.max_tokens, seed=args.seed, timeout_s=900.0, warmup=0,
        turns=args.turns, ignore_eos=True,
    ))  # fmt: skip
    flags = ["--parallel", str(args.parallel), "--threads", str(args.threads)]
    kvpark = kvpark_serve_command(model, args.port, *flags, "--kv-cells", str(args.kv_cells))
    servers: dict[str, tuple[list[str], str]] = {
        "kvpark": (kvpark, "/health"),
        "kvpark-no-cache": ([*kvpark, "--no-prefix-cache"], "/health"),
    }
    binary = llama_server_binary(args) if peers else None
    if binary is not None and binary.is_file():
        cmd = llama_server_command(
            str(binary), model, args.threads, args.port, args.kv_cells, args.parallel
        )
        servers["llama-server"] = ([*cmd, "--cache-reuse", "256"], "/health")
    elif binary is not None:
        if args.peer is not None:  # asked for by name: missing is an error, not a skip
            print(f"llama-server is not built at {binary}: run `kvpark bench build-llama-server`")
            return 2
        print(f"skipping llama-server: not built at {binary}")
    runs: list[RunResult] = []
    for label, (cmd, ready) in servers.items():
        print(f"== {label}: {' '.join(cmd)}", flush=True)
        log = args.out / "logs" / f"{args.name}-{label}.log"
        with managed_server(cmd, url + ready, log, timeout_s=600.0):
            (result,) = run([Target(url, label)], "multiturn", options)
        runs.append(result)
    summaries = {r.label: r.extra["multiturn"][0] for r in runs}
    goals = targets(summaries, args.pressure)
    meta = {
        "machine": machine(),
        "model_file": model,
        "commands": {label: cmd for label, (cmd, _) in servers.items()},
        "kv_cells": args.kv_cells, "parallel": args.parallel, "threads": args.threads,
        "targets": goals,
    }  # fmt: skip
    write_json(args.out / f"{args.name}.json", payload(runs, runs[0].label, {"meta": meta}))
    write_plot(args.out / f"{args.name}.png", runs, f"multiturn ({cpu_name()})")
    for label, s in summaries.items():
        late = s["ttft_p50_turns_3_on_s"]
        print(
            f"{label:>16}: wall {s['wall_s']:.1f} s, TTFT p50 turns 3+ "
            f"{'-' if late is None else f'{late * 1000:.0f} ms'}, computed "
            f"{s['prompt_tokens_computed']}/{s['prompt_tokens']} prompt tokens, "
            f"completed {s['completed']}"
        )
    print("\n".join(goals))
    return 0
