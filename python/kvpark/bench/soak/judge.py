"""The soak's verdict: each request's fate, then every check the run must pass.

A request's fate:

- ``match``: a good request that ended exactly as it did alone on the idle reference server;
- ``faulted``: a request (good or disconnecting) that an injected step fault ended with a 500
  naming the failed step (plain, or in-stream with ``finish_reason: "error"``);
- ``refused``: a bad input answered with a 400 and a JSON error naming the expected field;
- ``hung_up``: a disconnecting client that hung up as drawn (or whose stream ended first);
- anything else is a failure (``mismatch``, ``unprovoked_error``, ``unanswered``,
  ``bad_accepted``), listed in the report.

The checks (each ``{name, ok, detail}``): the server is alive and healthy at the end; no 5xx but
the provoked ones; no failure; at least one injected fault fired and every failed step's integrity
check passed; the pool was under pressure (requests parked); every category of traffic ran;
``kvpark_kv_cells_used`` back to 0 (cached pages are not counted there) and parked host bytes 0;
the integrity check at shutdown passed; no traceback but the faults' own; resident memory at the
end within ``RSS_SLACK`` of after the warm-up.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvpark.bench.soak.client import Outcome
from kvpark.bench.soak.plan import BAD, BAD_KINDS, DISCONNECT, MAX_N, SoakRequest
from kvpark.bench.soak.probe import FAULT_MESSAGE, LogFacts

RSS_SLACK = 0.10
FAILURES = ("mismatch", "unprovoked_error", "unanswered", "bad_accepted")


def _faulted(out: Outcome) -> bool:
    error = out.error or {}
    return error.get("message") == FAULT_MESSAGE and out.status in (200, 500)


def _server_error(out: Outcome) -> bool:
    """A 5xx: the status, or the code of an error sent in-stream."""
    code = (out.error or {}).get("code")
    return out.status >= 500 or (isinstance(code, int) and code >= 500)


def fate(request: SoakRequest, out: Outcome, reference: dict[str, Any] | None) -> str:
    if request.kind == BAD:
        error = out.error or {}
        named = request.param is None or error.get("param") == request.param
        return "refused" if out.status == 400 and error.get("message") and named else "bad_accepted"
    if _faulted(out):
        return "faulted"
    if out.transport is not None or out.error is not None or out.status != 200:
        return "unprovoked_error"
    if request.kind == DISCONNECT:
        return "hung_up" if out.hung_up or out.done else "unanswered"
    if not out.done:
        return "unanswered"
    return "match" if reference is not None and out.answer() == reference else "mismatch"


@dataclass(frozen=True)
class EndState:
    """The server as the run left it."""

    alive: bool
    healthy: bool
    cells_used: float
    cells_cached: float
    park_bytes: float
    parks: dict[str, float]  # by mode
    rss_warm_bytes: int
    rss_end_bytes: int
    log: LogFacts


def _categories(requests: list[SoakRequest], fates: list[str], log: LogFacts) -> dict[str, int]:
    good = [r for r in requests if r.kind not in (BAD, DISCONNECT)]
    parts = Counter(part for r in good for part in r.category.split("/"))
    seen = {name: parts[name] for name in ("chat", "completions", "stream", "plain", "greedy")}
    seen.update({name: parts[name] for name in ("seeded", "short", "long", "slow")})
    seen.update({f"n{n}": parts[f"n{n}"] for n in range(1, MAX_N + 1)})
    bad = Counter(r.bad for r in requests if r.kind == BAD)
    seen.update({f"bad/{kind}": bad[kind] for kind in BAD_KINDS})
    seen["disconnect"] = sum(r.kind == DISCONNECT for r in requests)
    seen["faults_fired"] = log.faults_fired
    seen["faulted_requests"] = fates.count("faulted")
    return seen


def judge(
    requests: list[SoakRequest],
    outcomes: dict[int, Outcome],
    references: dict[int, dict[str, Any]],
    end: EndState,
) -> dict[str, Any]:
    """Every request's fate and every check; ``passed`` when all checks hold."""
    fates = [fate(r, outcomes[r.index], references.get(r.index)) for r in requests]
    counts = Counter(fates)
    failures = [
        {
            "index": r.index,
            "category": r.category,
            "fate": f,
            "error": outcomes[r.index].error,
            "transport": outcomes[r.index].transport,
            "status": outcomes[r.index].status,
        }
        for r, f in zip(requests, fates, strict=True)
        if f in FAILURES
    ]
    five_xx = sum(
        f == "unprovoked_error" and _server_error(outcomes[r.index])
        for r, f in zip(requests, fates, strict=True)
    )
    categories = _categories(requests, fates, end.log)
    missing = [name for name, count in categories.items() if count == 0]
    log = end.log
    rss_ratio = end.rss_end_bytes / end.rss_warm_bytes if end.rss_warm_bytes else float("inf")
    parks = sum(end.parks.values())
    checks = [
        ("no crash", end.alive and end.healthy, f"alive {end.alive}, /health 200 {end.healthy}"),
        ("no 5xx but the provoked ones", five_xx == 0, f"{five_xx} unprovoked 5xx"),
        ("every request as expected", not failures, f"{len(failures)} failed: {dict(counts)}"),
        (
            "faults fired and checked",
            log.faults_fired >= 1 and log.step_checks_passed == log.faults_fired,
            f"{log.faults_fired} fired, {log.step_checks_passed} integrity checks passed",
        ),
        ("pool under pressure", parks > 0, f"parks by mode {end.parks}"),
        ("every category ran", not missing, f"missing {missing}" if missing else "all"),
        (
            "cells back",
            end.cells_used == 0,
            f"kv_cells_used {end.cells_used:g} (cached pages {end.cells_cached:g})",
        ),
        ("host park bytes 0", end.park_bytes == 0, f"preempt_ram_bytes {end.park_bytes:g}"),
        ("integrity at shutdown", log.shutdown_check_passed, "the check after serving"),
        (
            "no traceback but the faults'",
            log.tracebacks == log.faults_fired,
            f"{log.tracebacks} tracebacks",
        ),
        (
            f"RSS within {RSS_SLACK:.0%} of after warm-up",
            rss_ratio <= 1 + RSS_SLACK,
            f"{end.rss_warm_bytes / 2**20:.1f} -> {end.rss_end_bytes / 2**20:.1f} MiB "
            f"({rss_ratio:.3f}x)",
        ),
    ]
    return {
        "passed": all(ok for _, ok, _ in checks),
        "checks": [{"name": n, "ok": bool(ok), "detail": d} for n, ok, d in checks],
        "fates": dict(counts),
        "categories": categories,
        "failures": failures,
        "rss_ratio": rss_ratio,
    }


def format_verdict(verdict: dict[str, Any]) -> str:
    lines = [f"soak {'PASSED' if verdict['passed'] else 'FAILED'}; fates {verdict['fates']}"]
    for check in verdict["checks"]:
        lines.append(f"  [{'ok' if check['ok'] else 'FAIL'}] {check['name']}: {check['detail']}")
    for failure in verdict["failures"][:20]:
        lines.append(f"  failure: {failure}")
    return "\n".join(lines)
