"""The one Prometheus text parser of the tests, on ``prometheus_client``'s own."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def sample_key(name: str, labels: dict[str, str]) -> str:
    """A sample's name as the exposition writes it: ``name`` or ``name{a="x",b="y"}``."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a text exposition, histograms' (``_bucket``, ``_sum``, ``_count``) too,
    labelled ones under their full name as written: ``kvpark_preemptions_total{mode="swap"}``."""
    return {
        sample_key(sample.name, sample.labels): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """``GET {base_url}/metrics``, parsed."""
    return parse_metrics(httpx.get(f"{base_url}/metrics", headers=headers or {}, timeout=30).text)
