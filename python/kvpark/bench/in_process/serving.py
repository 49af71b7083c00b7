"""The in-process half of ``kvpark bench --scenario serving-overhead``: the engine alone
(``LLMEngine.step`` in a loop, ``--concurrency`` requests kept in flight, closed loop) runs the
workload the bench's sweep sends, and the last line printed is ``{"tok_s": ...}``.

    python -m kvpark.bench.in_process.serving --concurrency 8 --requests 16

The suite starts it as a subprocess, a fresh engine per repeat, so the bench client stays a
client (bench/in_process is the one part of the bench that imports the engine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import kvpark
from kvpark.bench import BenchOptions
from kvpark.bench.machine import default_model
from kvpark.bench.workload import build_requests
from kvpark.engine.outputs import ErrorEvent, FinishedEvent, TokenEvent


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=16, help="requests per level")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="r0", help="names the level's seeded prompts")
    args = p.parse_args(argv)
    options = BenchOptions(
        concurrency=(args.concurrency,), requests_per_level=args.requests,
        prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, seed=args.seed,
        timeout_s=900.0,
    )  # fmt: skip
    llm = kvpark.LLM(args.model or default_model(), threads=args.threads)
    in_process(llm, options, 1, "warmup")
    print(json.dumps({"tok_s": in_process(llm, options, args.concurrency, args.tag)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
