"""Scenarios: what a benchmark run sends to one server; async functions registered by name.

A scenario takes a ``Target`` and the run's ``BenchOptions`` and returns a ``RunResult`` (levels
plus request records); everything else (the table, JSON, plot, comparison of several servers) works
on ``RunResult`` and so on any scenario. To add one, write ``async def name(target, options)`` and
add it to ``SCENARIOS``.

- ``sweep``: for each concurrency in ``options.concurrency``, a closed (or Poisson) level of seeded
  chats of a fixed output length.
- ``multiturn``: for each N in ``options.concurrency``, N seeded conversations of
  ``options.turns`` turns, each turn the history (a system prompt shared by all, the earlier turns
  with the server's own answers) plus a new user message; TTFT and prompt tokens computed per
  turn (``multiturn.py``).
- ``pressure``: the headline workload: for each N in ``options.concurrency``, N chats sent
  at once, meant for a server whose pool holds each of them alone but not all together; it adds
  context errors, parks by mode (from ``/metrics``) and the ``preempt`` records (``pressure.py``).

``SCENARIO_DEFAULTS`` gives each scenario's concurrency, prompt and output lengths where the user
gives none.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

from kvpark.bench.client import Target, run_level
from kvpark.bench.multiturn import multiturn
from kvpark.bench.options import BenchOptions
from kvpark.bench.pressure import fit_check, summarize_pressure
from kvpark.bench.report import RunResult, request_record, summarize_level
from kvpark.bench.scrape import fetch_props, metrics_delta, scrape_metrics
from kvpark.bench.workload import WorkloadConfig, build_requests

# Workload flags a user does not give, per scenario. pressure: 4 and 8 chats of ~350-token prompts
# and 300 tokens out (~680 cells each with the chat template), for a pool of about 1024 cells.
SCENARIO_DEFAULTS: dict[str, dict[str, Any]] = {
    "sweep": {"concurrency": (1, 4, 8, 16), "prompt_tokens": 64, "max_tokens": 128},
    "pressure": {"concurrency": (4, 8), "prompt_tokens": 350, "max_tokens": 300},
    # multiturn: 8 conversations, a ~300-token system prompt shared by all, 32 tokens a turn
    "multiturn": {"concurrency": (8,), "prompt_tokens": 300, "max_tokens": 32},
}


Scenario = Callable[[Target, BenchOptions], Awaitable[RunResult]]


def progress(message: str) -> None:
    """One line per finished level on stderr, so a slow server does not look like a hang."""
    print(message, file=sys.stderr, flush=True)


async def warm_up(target: Target, options: BenchOptions, model: str) -> None:
    """Send ``options.warmup`` short requests one at a time; their outcome is not recorded."""
    if options.warmup == 0:
        return
    config = WorkloadConfig(
        requests=options.warmup,
        prompt_tokens=options.prompt_tokens,
        max_tokens=4,
        seed=options.seed,
        endpoint=options.endpoint,
        tag="warmup",
    )
    await run_level(target, options.body(model), build_requests(config), 1, options.timeout_s)


async def sweep(target: Target, options: BenchOptions) -> RunResult:
    """One level per concurrency, in the order given; each level sends its own seeded prompts."""
    assert target.model is not None, "resolve the model name before running a scenario"
    run = RunResult(target.label, target.url, target.model, "sweep", options.to_json())
    await warm_up(target, options, target.model)
    body = options.body(target.model)
    for concurrency in options.concurrency:
        config = options.workload(options.requests_for(concurrency), f"c{concurrency}")
        wall_s, results = await run_level(
            target, body, build_requests(config), concurrency, options.timeout_s
        )
        level = summarize_level(concurrency, wall_s, results)
        run.levels.append(level)
        progress(
            f"[{target.label}] {concurrency} chats: {level.ok}/{level.requests} ok, "
            f"{level.tokens_out} tokens in {wall_s:.1f} s, {level.aggregate_tok_s:.1f} tok/s"
        )
        run.requests[concurrency] = [request_record(r) for r in results]
    return run


async def pressure(target: Target, options: BenchOptions) -> RunResult:
    """One level per N in ``options.concurrency``: N seeded chats sent at once
    (``requests_per_level`` instead of N when given), at most N in flight. Around each level it
    reads ``/metrics`` for the parks by mode; ``/props`` says whether the level really was "each
    fits alone, not together".

    Besides the usual levels and records, ``run.extra`` holds ``pressure`` (one
    ``PressureLevel.to_json()`` per level), ``fit`` (per N, ``fit_check``) and ``props``.
    """
    assert target.model is not None, "resolve the model name before running a scenario"
    run = RunResult(target.label, target.url, target.model, "pressure", options.to_json())
    props = await fetch_props(target)
    if props is not None:
        run.extra["props"] = props
    await warm_up(target, options, target.model)
    body = options.body(target.model)
    summaries: list[dict[str, Any]] = []
    fits: dict[str, Any] = {}
    for chats in options.concurrency:
        config = options.workload(options.requests_per_level or chats, f"p{chats}")
        before = await scrape_metrics(target)
        wall_s, results = await run_level(
            target, body, build_requests(config), chats, options.timeout_s
        )
        after = await scrape_metrics(target)
        level = summarize_pressure(chats, wall_s, results, metrics_delta(before, after))
        run.levels.append(summarize_level(chats, wall_s, results))
        run.requests[chats] = [request_record(r) for r in results]
        summaries.append(level.to_json())
        fit = fit_check(props, chats, level.prompt_tokens_max, options.max_tokens)
        fits[str(chats)] = fit
        parks = "?" if level.parks is None else str(level.parks)
        progress(
            f"[{target.label}] {chats} chats: {level.completed}/{level.requests} completed, "
            f"{level.context_errors} context errors, {parks} parks "
            f"(swap {level.parks_swap}, recompute {level.parks_recompute}), "
            f"{wall_s:.1f} s, {level.aggregate_tok_s:.1f} tok/s"
        )
        if fit is not None and not fit["under_pressure"]:
            why = (
                "do not fit alone"
                if not fit["fits_alone"]
                else "fit together"
                if fit["fits_together"]
                else "are admitted one at a time"
            )
            progress(
                f"[{target.label}] warning: {chats} chats of ~{fit['cells_per_chat']} cells {why} "
                f"in a pool of {fit['kv_cells']} cells ({fit['parallel']} slots): not the "
                "intended pressure"
            )
    run.extra["pressure"] = summaries
    run.extra["fit"] = fits
    return run


SCENARIOS: dict[str, Scenario] = {"sweep": sweep, "pressure": pressure, "multiturn": multiturn}
