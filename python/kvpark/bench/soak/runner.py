"""Running a soak plan's entries against one server: ``concurrency`` entries in flight (a burst
is one entry whose requests go out at once), until the plan or the time runs out; and the
references, each good request sent alone to an idle server.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import httpx

from kvpark.bench.soak.client import Outcome, send
from kvpark.bench.soak.plan import GOOD, SoakRequest

CONNECTIONS = 64  # above the concurrency plus the biggest burst


def client(timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    return httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False)


async def run_entries(
    base_url: str,
    entries: list[list[SoakRequest]],
    concurrency: int,
    timeout_s: float,
    deadline: float,
) -> dict[int, Outcome]:
    """Every entry's outcomes by request index; entries not started by ``deadline``
    (``time.monotonic``) are skipped, and so missing from the result."""
    outcomes: dict[int, Outcome] = {}
    pending = list(reversed(entries))
    async with client(timeout_s) as http:

        async def worker() -> None:
            while pending and time.monotonic() < deadline:
                entry = pending.pop()
                for out in await asyncio.gather(*(send(http, base_url, r) for r in entry)):
                    outcomes[out.index] = out

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


async def run_references(
    base_url: str, requests: list[SoakRequest], timeout_s: float
) -> dict[int, dict[str, Any]]:
    """Each good request's answer alone on an idle server, not streamed (a stream's tokens are
    the same); a reference that fails stops the soak, as nothing could be judged against it."""
    references: dict[int, dict[str, Any]] = {}
    good = [r for r in requests if r.kind == GOOD]
    async with client(timeout_s) as http:
        for done, request in enumerate(good, 1):
            alone = SoakRequest(
                request.index, GOOD, request.endpoint, False, request.reference_body()
            )
            out = await send(http, base_url, alone)
            if out.status != 200 or out.error is not None or out.transport is not None:
                raise RuntimeError(f"reference of request {request.index} failed: {out}")
            references[request.index] = out.answer()
            if done % 25 == 0 or done == len(good):
                print(f"[soak] references: {done}/{len(good)}", file=sys.stderr, flush=True)
    return references
