"""Suites: the published benchmarks, each one ``kvpark bench --scenario NAME`` that starts the
servers it needs (``python -m kvpark serve``, llama.cpp's peers) one at a time, runs scenarios
against them and writes ``<out>/<name>.json`` (and a PNG): ``cpu-comparison``, ``quant-types``
(the same against llama-server on each quant type), ``pressure`` and
``multiturn`` (when no ``--url`` is given; with one, those two drive the given servers),
``exact-cost``, ``serving-overhead``, ``soak`` (a judged soak of one server under pressure);
and the in-process benchmarks run as scripts
(``in_process.py``). Each suite module has ``main(argv)``; ``SUITES`` maps names to them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from kvpark.bench.suites import (
    cpu_comparison,
    exact_cost,
    multiturn,
    pressure,
    quant_types,
    serving_overhead,
    soak,
)
from kvpark.bench.suites.in_process import SCRIPTS
from kvpark.bench.suites.in_process import main as run_in_process

Suite = Callable[[list[str]], int]

SUITES: dict[str, Suite] = {
    "cpu-comparison": cpu_comparison.main,
    "quant-types": quant_types.main,
    "pressure": pressure.main,
    "multiturn": multiturn.main,
    "exact-cost": exact_cost.main,
    "serving-overhead": serving_overhead.main,
    "soak": soak.main,
    **{name: partial(run_in_process, name) for name in SCRIPTS},
}
# the suites that are also load-generator scenarios: with --url they drive the given servers
SERVER_SCENARIOS = ("pressure", "multiturn")

__all__ = ["SERVER_SCENARIOS", "SUITES", "Suite"]
