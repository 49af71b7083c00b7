"""``BenchOptions``: everything a scenario needs besides its target, one field per flag of
``kvpark bench``; the scenarios (scenarios.py, multiturn.py, pressure.py) and the suites read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvpark.bench.client import RequestBody
from kvpark.bench.workload import WorkloadConfig, default_requests_per_level

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
    turns: int = 6  # multiturn: turns per conversation

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
        if not 1 <= self.turns <= 64:
            raise ValueError("turns must be within 1..64")

    def requests_for(self, concurrency: int) -> int:
        fixed = self.requests_per_level
        return default_requests_per_level(concurrency) if fixed is None else fixed

    def workload(self, requests: int, tag: str) -> WorkloadConfig:
        """The seeded workload of one level: ``requests`` prompts, tagged so levels differ."""
        return WorkloadConfig(
            requests=requests,
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
            seed=self.seed,
            arrival=self.arrival,
            rate=self.rate,
            endpoint=self.endpoint,
            tag=tag,
        )

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
