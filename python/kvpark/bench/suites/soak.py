"""``kvpark bench --scenario soak``: a bounded, seeded soak of one ``--exact`` server whose pool
is too small for its load, judged on what a production server must never do.

    kvpark bench --scenario soak --requests 300 --out bench-results   # -> soak.{json,png}

First a reference server (the same flags, nothing injected) answers every good request alone,
one at a time. Then the soak server, started with ``KVPARK_FAULT_STEP`` at a few drawn steps,
gets the whole plan (``soak/plan.py``: chat and completions, streamed and not, ``n`` 1-3, greedy
and seeded, short and long prompts over shared prefixes, slow readers, bad inputs, disconnect
bursts of 10-20), ``--concurrency`` entries in flight. The warm-up is the traffic before the first
burst; the RSS after it is the baseline. At the end the suite waits for the pool to empty, reads
``/metrics``, ``/health`` and the RSS, stops the server with SIGTERM and reads its log.
The verdict's checks are in ``soak/judge.py``; the exit status is 0 only when all pass.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx

from kvpark.bench.machine import machine
from kvpark.bench.report import write_json
from kvpark.bench.servers import kvpark_serve_command, managed_server
from kvpark.bench.soak.client import Outcome
from kvpark.bench.soak.judge import EndState, format_verdict, judge
from kvpark.bench.soak.plan import DISCONNECT, GOOD, SoakPlan, build_plan
from kvpark.bench.soak.plot import write_soak_plot
from kvpark.bench.soak.probe import LogFacts, Sampler, metrics, rss_bytes
from kvpark.bench.soak.runner import run_entries, run_references
from kvpark.bench.suites.arguments import model_of, suite_parser

SCENARIO = "soak"
SETTLE_S = 60.0  # how long the end waits for aborted requests' cells to come back


def fault_steps(plan: SoakPlan, concurrency: int, count: int, seed: int) -> list[int]:
    """``count`` distinct steps between a fifth and four fifths of a low estimate of the run's
    model steps (every step as full as the concurrency and ``n`` allow), so that they fire."""
    requests = plan.requests
    tokens = sum(
        r.body.get("n", 1) * r.body.get("max_tokens", 0) for r in requests if r.kind == GOOD
    ) + sum(r.cut_after for r in requests if r.kind == DISCONNECT)
    mean_n = sum(r.body.get("n", 1) for r in requests if r.kind == GOOD) / max(1, len(requests))
    steps = max(5 * count + 10, int(tokens / (concurrency * max(1.0, mean_n))))
    rng = random.Random(f"kvpark-soak-faults/{seed}")
    return sorted(rng.sample(range(steps // 5, steps * 4 // 5), count))


async def _settle(url: str) -> dict[str, float]:
    """``/metrics`` once no cell is held, or after ``SETTLE_S``."""
    deadline = time.monotonic() + SETTLE_S
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        page = await metrics(client, url)
        while page.get("kvpark_kv_cells_used", 0.0) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            page = await metrics(client, url)
        return page


async def _soak(
    url: str, plan: SoakPlan, pid: int, concurrency: int, timeout_s: float, time_limit_s: float
) -> dict[str, Any]:
    stop = asyncio.Event()
    sampler = Sampler(url, pid)
    sampling = asyncio.create_task(sampler.run(stop))
    first_burst = next((i for i, e in enumerate(plan.entries) if len(e) > 1), len(plan.entries))
    warm = max(1, first_burst)
    deadline = time.monotonic() + time_limit_s
    started = time.perf_counter()
    outcomes: dict[int, Outcome] = await run_entries(
        url, plan.entries[:warm], concurrency, timeout_s, deadline
    )
    await _settle(url)
    rss_warm = rss_bytes(pid)
    outcomes.update(await run_entries(url, plan.entries[warm:], concurrency, timeout_s, deadline))
    wall_s = time.perf_counter() - started
    page = await _settle(url)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        healthy = (await client.get(url + "/health")).status_code == 200
    rss_end = rss_bytes(pid)
    stop.set()
    await sampling
    return {
        "outcomes": outcomes,
        "page": page,
        "healthy": healthy,
        "rss_warm": rss_warm,
        "rss_end": rss_end,
        "wall_s": wall_s,
        "series": sampler.series,
        "warm_entries": warm,
    }


def main(argv: list[str]) -> int:
    p = suite_parser(SCENARIO, "A seeded soak of one --exact server under pressure.", SCENARIO)
    p.add_argument(
        "--requests", type=int, default=300, help="requests in the plan (60+: all kinds)"
    )
    p.add_argument("--concurrency", type=int, default=8, help="plan entries in flight")
    p.add_argument("--max-tokens", type=int, default=32, help="longest output of a request")
    p.add_argument("--kv-cells", type=int, default=512, help="the soak server's pool")
    p.add_argument("--parallel", type=int, default=8, help="the soak server's slots")
    p.add_argument("--preempt-ram", type=int, default=8, help="MiB for swaps (the rest recompute)")
    p.add_argument("--faults", type=int, default=None, help="injected step faults (default 1/60)")
    p.add_argument("--time-limit", type=float, default=1800.0, help="seconds to start entries")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--port", type=int, default=8125)
    p.add_argument("--kvpark-arg", action="append", default=[], help="extra kvpark serve flag")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 4:
        p.error("--requests and --concurrency must be positive, --max-tokens at least 4")
    plan = build_plan(args.seed, args.requests, "default", args.max_tokens)
    if plan.max_cells() > args.kv_cells:
        p.error(
            f"--kv-cells {args.kv_cells} cannot hold the longest request alone "
            f"(up to {plan.max_cells()} cells)"
        )
    faults = args.faults if args.faults is not None else max(2, args.requests // 60)
    steps = fault_steps(plan, args.concurrency, faults, args.seed)
    flags = [
        "--exact",
        "--kv-cells",
        str(args.kv_cells),
        "--parallel",
        str(args.parallel),
        "--preempt-ram",
        str(args.preempt_ram),
        "--threads",
        str(args.threads),
        *args.kvpark_arg,
    ]
    cmd = kvpark_serve_command(model_of(args), args.port, *flags)
    url = f"http://127.0.0.1:{args.port}"
    logs: Path = args.out / "logs"
    print(f"== soak reference: {' '.join(cmd)}", flush=True)
    with managed_server(cmd, url + "/health", logs / "soak-reference.log", timeout_s=600.0):
        references = asyncio.run(run_references(url, plan.requests, args.timeout))
    env = {**os.environ, "KVPARK_FAULT_STEP": ",".join(map(str, steps))}
    soak_log = logs / "soak-server.log"
    print(f"== soak: KVPARK_FAULT_STEP={env['KVPARK_FAULT_STEP']} {' '.join(cmd)}", flush=True)
    with managed_server(cmd, url + "/health", soak_log, timeout_s=600.0, env=env) as process:
        result = asyncio.run(
            _soak(url, plan, process.pid, args.concurrency, args.timeout, args.time_limit)
        )
        alive = process.poll() is None
    page = result["page"]
    end = EndState(
        alive=alive and process.returncode == 0,
        healthy=result["healthy"],
        cells_used=page.get("kvpark_kv_cells_used", -1.0),
        cells_cached=page.get("kvpark_kv_cells_cached", -1.0),
        park_bytes=page.get("kvpark_preempt_ram_bytes", -1.0),
        parks={
            mode: page.get(f"kvpark_preemptions_total{{mode={mode}}}", 0.0)
            for mode in ("swap", "recompute")
        },
        rss_warm_bytes=result["rss_warm"],
        rss_end_bytes=result["rss_end"],
        log=LogFacts.read(soak_log),
    )
    outcomes: dict[int, Outcome] = result["outcomes"]
    ran = [r for r in plan.requests if r.index in outcomes]
    verdict = judge(ran, outcomes, references, end)
    doc: dict[str, Any] = {
        "scenario": SCENARIO,
        "machine": machine(),
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "fault_steps": steps,
            "command": cmd,
        },
        "verdict": verdict,
        "requests": {
            "planned": len(plan.requests),
            "ran": len(ran),
            "skipped": len(plan.requests) - len(ran),
        },
        "wall_s": result["wall_s"],
        "warm_entries": result["warm_entries"],
        "end": {**vars(end), "log": vars(end.log), "exit_status": process.returncode},
        "series": result["series"],
    }
    write_json(args.out / f"{args.name}.json", doc)
    plot = write_soak_plot(args.out / f"{args.name}.png", doc)
    print(format_verdict(verdict))
    print(
        f"{len(ran)} requests in {result['wall_s']:.1f} s; wrote {args.out / args.name}.json"
        + (" and .png" if plot else "")
    )
    return 0 if verdict["passed"] else 1
