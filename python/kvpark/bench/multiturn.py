"""The ``multiturn`` scenario: conversations that come back (issue 13's workload).

For each N in ``options.concurrency``, N seeded conversations run side by side, each of
``options.turns`` turns sent one after another: turn ``t`` sends the whole history (a system
prompt of ~``options.prompt_tokens`` tokens shared by every conversation, the earlier user
messages and the server's own answers) plus a new user message, and waits for its answer. Per
turn it records the time to first token, the prompt tokens and those the server's prefix cache
supplied (``usage.prompt_tokens_details.cached_tokens``, or llama.cpp's ``timings.cache_n``), so
the prompt tokens each turn computed.

``run.extra["multiturn"]`` holds one summary per N: median TTFT of turns 3 and later, the
workload's wall time, prompt tokens sent and computed, and the share the cache served.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from typing import Any

from kvpark.bench.client import RequestResult, Target, stream_one
from kvpark.bench.options import BenchOptions
from kvpark.bench.report import RunResult, request_record, summarize_level
from kvpark.bench.workload import RequestSpec, prompt_text

FIRST_MEASURED_TURN = 3  # turns before it warm the cache; the median TTFT is over the rest
QUESTIONS = (
    "Tell me more about the {w} part.",
    "Why does the {w} matter here?",
    "Give one example with a {w}.",
    "Summarise that in terms of the {w}.",
    "What would change without the {w}?",
    "How does the {w} relate to the rest?",
)
WORDS = ("river", "engine", "garden", "ladder", "signal", "harbour", "lantern", "market")


def system_prompt(seed: int, tokens: int) -> str:
    """The system prompt every conversation shares: ~``tokens`` tokens of seeded words."""
    return "You are a patient guide. Keep this context in mind: " + prompt_text(
        seed, 0, max(1, tokens - 20), "multiturn-system"
    )


def user_message(seed: int, conversation: int, turn: int) -> str:
    rng = random.Random(f"kvpark-bench/{seed}/multiturn/{conversation}/{turn}")
    return rng.choice(QUESTIONS).format(w=rng.choice(WORDS))


async def conversation(
    target: Target,
    options: BenchOptions,
    index: int,
    system: str,
    t0: float,
) -> list[RequestResult]:
    """One conversation's turns, in order; a failed turn ends it (its history would be wrong)."""
    body = options.body(target.model or "")
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    results = []
    for turn in range(options.turns):
        messages.append({"role": "user", "content": user_message(options.seed, index, turn)})
        spec = RequestSpec(
            index * options.turns + turn, "", options.max_tokens, 0.0, tuple(messages)
        )
        result = RequestResult(spec.index)
        try:
            await asyncio.wait_for(stream_one(target, body, spec, t0, result), options.timeout_s)
        except asyncio.TimeoutError:
            result.error = f"timed out after {options.timeout_s:g} s"
        results.append(result)
        if not result.ok:
            break
        messages.append({"role": "assistant", "content": "".join(result.text)})
    return results


def summarize(n: int, wall_s: float, turns: int, results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    late = [
        t for r in ok if r.index % turns + 1 >= FIRST_MEASURED_TURN and (t := r.ttft_s) is not None
    ]
    sent = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    return {
        "conversations": n,
        "turns": turns,
        "completed": len(ok) == n * turns,
        "errors": len(results) - len(ok) + (n * turns - len(results)),
        "wall_s": wall_s,
        "ttft_p50_turns_3_on_s": statistics.median(late) if late else None,
        "prompt_tokens": sent,
        "prompt_tokens_cached": cached,
        "prompt_tokens_computed": sent - cached,
        "cache_share": cached / sent if sent else None,
        "reports_cache": any(r.cached_tokens is not None for r in ok),
        "per_turn": [
            {
                "turn": t + 1,
                "ttft_p50_s": _median([r.ttft_s for r in ok if r.index % turns == t]),
                "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok if r.index % turns == t),
                "computed": sum(
                    (r.prompt_tokens or 0) - (r.cached_tokens or 0)
                    for r in ok
                    if r.index % turns == t
                ),
            }
            for t in range(turns)
        ],
    }


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


async def multiturn(target: Target, options: BenchOptions) -> RunResult:
    assert target.model is not None, "resolve the model name before running a scenario"
    run = RunResult(target.label, target.url, target.model, "multiturn", options.to_json())
    system = system_prompt(options.seed, options.prompt_tokens)
    summaries = []
    for n in options.concurrency:
        t0 = time.perf_counter()
        per = await asyncio.gather(
            *(conversation(target, options, i, system, t0) for i in range(n))
        )
        wall_s = time.perf_counter() - t0
        results = [r for turns in per for r in turns]
        run.levels.append(summarize_level(n, wall_s, results))
        run.requests[n] = [{**request_record(r), "cached_tokens": r.cached_tokens} for r in results]
        summary = summarize(n, wall_s, options.turns, results)
        summaries.append(summary)
        late = summary["ttft_p50_turns_3_on_s"]
        share = summary["cache_share"]
        print(
            f"[{target.label}] {n} conversations x {options.turns} turns: "
            f"{'completed' if summary['completed'] else 'NOT completed'}, {wall_s:.1f} s, "
            f"TTFT p50 turns {FIRST_MEASURED_TURN}+ "
            f"{'-' if late is None else f'{late * 1000:.0f} ms'}, prompt tokens computed "
            f"{summary['prompt_tokens_computed']}/{summary['prompt_tokens']}"
            f"{'' if share is None else f' (cache {share:.0%})'}",
            file=sys.stderr,
            flush=True,
        )
    run.extra["multiturn"] = summaries
    return run
