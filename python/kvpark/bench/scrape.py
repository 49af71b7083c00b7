"""What the bench reads from a server besides its answers: the preemption counters of
``/metrics`` (before and after a level) and kvpark's ``/props``; None from a server without them.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpark.bench.client import Target

# (metric name, mode label or None) -> key in a metrics snapshot
_METRIC_KEYS: dict[tuple[str, str | None], str] = {
    ("kvpark_preemptions_total", "swap"): "parks_swap",
    ("kvpark_preemptions_total", "recompute"): "parks_recompute",
    ("kvpark_recomputed_tokens_total", None): "recomputed_tokens",
    ("kvpark_resumes_total", None): "resumes",
    ("kvpark_rotations_total", None): "rotations",
}
METRIC_FIELDS = tuple(_METRIC_KEYS.values())


def parse_metrics(text: str) -> dict[str, float]:
    """The preemption counters of a Prometheus text page (missing ones are left out), read by
    ``prometheus_client``'s own parser; a page it cannot parse gives what it read before."""
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = _METRIC_KEYS.get((sample.name, sample.labels.get("mode")))
                if key is not None:
                    out[key] = float(sample.value)
    except ValueError:
        pass
    return out


def metrics_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, int] | None:
    """How much each counter grew over a level; None when either scrape failed."""
    if before is None or after is None:
        return None
    return {k: round(after[k] - before.get(k, 0.0)) for k in METRIC_FIELDS if k in after}


async def scrape_metrics(target: Target, timeout_s: float = 30.0) -> dict[str, float] | None:
    """The preemption counters of ``GET /metrics``; None when the server has no such page."""
    text = await _get(target, "/metrics", timeout_s)
    return None if text is None else parse_metrics(text)


async def fetch_props(target: Target, timeout_s: float = 30.0) -> dict[str, Any] | None:
    """kvpark's ``GET /props`` (pool and preemption settings); None for other servers."""
    text = await _get(target, "/props", timeout_s)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


async def _get(target: Target, path: str, timeout_s: float) -> str | None:
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            response = await client.get(target.url.rstrip("/") + path, headers=target.headers())
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None
