"""The benchmarks that run an engine inside their own process (profile, roofline, grammar masks,
the llama.cpp reference, the GPU check, the serving-overhead's in-process half): ``kvpark bench
--scenario NAME [its flags]`` runs ``python -m kvpark.bench.in_process.<module>`` in a subprocess
with the flags given, as the suites run servers. A subprocess keeps the bench a client that
imports nothing of the engine (only ``bench/in_process`` does, and nothing imports it), and keeps
torch out of ``kvpark bench`` itself. The modules ship in the package, so an installed kvpark
runs them as a checkout does.
"""

from __future__ import annotations

import subprocess
import sys

PACKAGE = "kvpark.bench.in_process"
# scenario -> (the module under kvpark/bench/in_process/, what it measures)
SCRIPTS: dict[str, tuple[str, str]] = {
    "profile": ("profile_engine", "where an in-process engine's step time goes"),
    "roofline": ("roofline", "a decode step against the bytes it must read"),
    "grammar-overhead": ("grammar_overhead", "grammar masks' share of a decode step"),
    "grammar-mask-cost": ("grammar_mask_cost", "llguidance against xgrammar, per token"),
    "llamacpp-reference": ("llamacpp_reference", "llama.cpp's greedy tokens, for tests"),
    "gpu-check": ("gpu_check", "the GPU tests and figures (on a GPU machine)"),
}


def module_command(module: str, args: list[str]) -> list[str]:
    """The command that runs ``kvpark.bench.in_process.<module>`` with ``args`` in this
    interpreter."""
    return [sys.executable, "-m", f"{PACKAGE}.{module}", *args]


def without_scenario(argv: list[str]) -> list[str]:
    """``argv`` less its ``--scenario NAME`` (or ``--scenario=NAME``): the script's own flags."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--scenario":
            skip = True
        elif not arg.startswith("--scenario="):
            out.append(arg)
    return out


def main(scenario: str, argv: list[str]) -> int:
    module, _ = SCRIPTS[scenario]
    return subprocess.call(module_command(module, without_scenario(argv)))
