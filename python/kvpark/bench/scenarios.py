"""Scenarios: what a benchmark run sends to one server; async functions registered by name.

A scenario takes a ``Target`` and the run's ``BenchOptions`` and returns a ``RunResult`` (levels
plus request records); everything else (the table, JSON, plot, comparison of several servers) works
on ``RunResult`` and so on any scenario. To add one, write ``async def name(target, options)`` and
add it to ``SCENARIOS``.

- ``sweep``: for each concurrency in ``options.concurrency``, a closed (or Poisson) level of seeded
  chats of a fixed output length.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpark.bench.client import RequestBody, Target, run_level
from kvpark.bench.report import RunResult, request_record, summarize_level
from kvpark.bench.workload import WorkloadConfig, build_requests, default_requests_per_level

MAX_REQUESTS_PER_LEVEL = 256


@dataclass(frozen=True)
class BenchOptions:
    """Everything a scenario needs besides the target; flags of ``kvpark bench`` map one to one."""

    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    requests_per_level: int | None = None  # None: ``default_requests_per_level(concurrency)``
    prompt_tokens: int = 64
    max_tokens: int = 128
    seed: int = 0
    timeout_s: float = 300.0  # per request
    warmup: int = 1  # short requests sent first and not counted (first-request costs)
    arrival: str = "closed"
    rate: float = 0.0
    endpoint: str = "chat"
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be positive")
        if max(self.concurrency) > MAX_REQUESTS_PER_LEVEL:
            raise ValueError(f"concurrency is limited to {MAX_REQUESTS_PER_LEVEL}")
        rpl = self.requests_per_level
        if rpl is not None and not 1 <= rpl <= MAX_REQUESTS_PER_LEVEL:
            raise ValueError(f"requests per level must be within 1..{MAX_REQUESTS_PER_LEVEL}")
        if self.timeout_s <= 0:
            raise ValueError("timeout must be positive")
        if not 0 <= self.warmup <= 8:
            raise ValueError("warmup must be within 0..8")

    def requests_for(self, concurrency: int) -> int:
        fixed = self.requests_per_level
        return default_requests_per_level(concurrency) if fixed is None else fixed

    def body(self, model: str) -> RequestBody:
        return RequestBody(
            model=model,
            endpoint=self.endpoint,
            temperature=self.temperature,
            ignore_eos=self.ignore_eos,
            extra=dict(self.extra_body),
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["concurrency"] = list(self.concurrency)
        return data


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
        config = WorkloadConfig(
            requests=options.requests_for(concurrency),
            prompt_tokens=options.prompt_tokens,
            max_tokens=options.max_tokens,
            seed=options.seed,
            arrival=options.arrival,
            rate=options.rate,
            endpoint=options.endpoint,
            tag=f"c{concurrency}",
        )
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


SCENARIOS: dict[str, Scenario] = {"sweep": sweep}
