"""The ``/metrics`` gauges of what the server keeps for clients beside the engine's pool:
reattachable streams (``--reattach-seconds``) and stored responses (``--response-store``). Read
at scrape time, like the engine's (server/metrics.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from kvpark.server.reattach import Reattach
from kvpark.server.response_store import ResponseStore


class KeptCollector:
    def __init__(self, reattach: Reattach, responses: ResponseStore) -> None:
        self.reattach = reattach
        self.responses = responses

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvpark_reattach_streams",
            "Reattachable streams kept (attached or not)",
            value=len(self.reattach),
        )
        yield GaugeMetricFamily(
            "kvpark_reattach_detached_streams",
            "Reattachable streams kept without a connection, waiting to be picked up",
            value=self.reattach.detached(),
        )
        yield GaugeMetricFamily(
            "kvpark_reattach_bytes",
            "Bytes the reattachable streams' event logs hold",
            value=self.reattach.held_bytes(),
        )
        yield GaugeMetricFamily(
            "kvpark_responses_stored", "Responses in the response store", value=len(self.responses)
        )
        yield GaugeMetricFamily(
            "kvpark_responses_stored_bytes",
            "Bytes the stored responses hold (objects, conversations, background events)",
            value=self.responses.held_bytes(),
        )
