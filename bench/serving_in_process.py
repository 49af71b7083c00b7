"""What the serving path costs: one workload in-process, then through the HTTP server, in one run.

    .venv/bin/python bench/run_serving_overhead.py          # -> bench-results/serving.json

In-process, the engine alone (``LLMEngine.step`` in a loop, ``--concurrency`` requests kept in
flight, closed loop) runs the workload ``kvpark bench`` sends; then ``kvpark serve`` with the same
flags runs the same seeded sweep over HTTP (engine thread, asyncio, SSE, the bench client on the
same cores). Both count generated tokens over the wall time of the level. Goal (issue 12): the
server keeps at least 90 % of in-process aggregate tok/s at 8 chats. ``--repeats`` alternates the
two and reports medians (the VM moves ~15 % between runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvpark
from kvpark.bench import BenchOptions, Target, run
from kvpark.bench.report import pyplot
from kvpark.bench.workload import build_requests
from kvpark.engine.outputs import ErrorEvent, FinishedEvent, TokenEvent
from peer_llamacpp import managed_server
from run_cpu_comparison import cpu_flags, cpu_name, default_model

GOAL = 0.9


def in_process(llm: kvpark.LLM, options: BenchOptions, concurrency: int, tag: str) -> float:
    """Aggregate tok/s of one closed-loop level on the engine alone (the bench's prompts, chat
    template applied as the server's chat route does)."""
    engine, tok = llm.engine, llm.tokenizer
    specs = build_requests(options.workload(options.requests_for(concurrency), tag))
    params = kvpark.SamplingParams(
        max_tokens=options.max_tokens, temperature=0.0, ignore_eos=options.ignore_eos
    )
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": s.prompt}])) for s in specs
    ]
    pending, live, tokens = list(enumerate(prompts)), 0, 0
    started = time.perf_counter()
    while pending or live:
        while pending and live < concurrency:
            i, ids = pending.pop(0)
            engine.add_request(f"{tag}-{i}", ids, params)
            live += 1
        for events in engine.step().values():
            for event in events:
                if isinstance(event, TokenEvent):
                    tokens += len(event.token_ids)
                elif isinstance(event, FinishedEvent | ErrorEvent):
                    live -= 1
    return tokens / (time.perf_counter() - started)


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=16, help="requests per level")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--port", type=int, default=8126)
    p.add_argument("--kvpark-arg", action="append", default=[], help="extra kvpark serve flag")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    args = p.parse_args()
    model = args.model or default_model()
    options = BenchOptions(
        concurrency=(args.concurrency,), requests_per_level=args.requests,
        prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, timeout_s=900.0,
    )  # fmt: skip
    cmd = [sys.executable, "-m", "kvpark", "serve", "--host", "127.0.0.1", "--port"]
    cmd += [str(args.port), "--model", model, "--threads", str(args.threads), *args.kvpark_arg]
    url = f"http://127.0.0.1:{args.port}"
    figures: dict[str, list[float]] = {"in_process": [], "server": []}
    for repeat in range(args.repeats):
        llm = kvpark.LLM(model, threads=args.threads)
        in_process(llm, options, 1, "warmup")
        figures["in_process"].append(in_process(llm, options, args.concurrency, f"r{repeat}"))
        del llm
        log = args.out / "logs" / f"serving-{repeat}.log"
        with managed_server(cmd, url + "/health", log, timeout_s=600.0):
            result = run([Target(url, "kvpark server")], "sweep", options)[0]
        figures["server"].append(result.levels[0].aggregate_tok_s)
        print(f"repeat {repeat}: in-process {figures['in_process'][-1]:.1f} tok/s, "
              f"server {figures['server'][-1]:.1f} tok/s", flush=True)  # fmt: skip
    medians = {k: statistics.median(v) for k, v in figures.items()}
    ratio = medians["server"] / medians["in_process"]
    doc: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "flags": cpu_flags(), "cores": os.cpu_count(),
                    "system": platform.platform()},
        "model_file": model, "command": cmd, "concurrency": args.concurrency,
        "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "tok_s": figures, "median_tok_s": medians,
        "server_over_in_process": ratio, "goal": {"target": GOAL, "met": ratio >= GOAL},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(doc, indent=2))
    write_plot(args.out / "serving.png", figures, f"serving path at {args.concurrency} chats")
    print(f"median: in-process {medians['in_process']:.1f}, server {medians['server']:.1f} tok/s:"
          f" {ratio:.2f}x (goal {GOAL}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
