"""The benchmarks that run an engine inside their own process (profile, roofline, grammar masks,
the llama.cpp reference, the GPU check): ``kvpark bench --scenario NAME [its flags]`` runs the
source checkout's ``bench/<script>.py`` in a subprocess with the flags given, as the suites run
servers. They stay scripts because the bench is a client that imports nothing of the engine; a
subprocess keeps it so, and keeps torch out of ``kvpark bench`` itself.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvpark.bench.machine import REPO

# scenario -> (the script under bench/, what it measures)
SCRIPTS: dict[str, tuple[str, str]] = {
    "profile": ("profile_engine.py", "where an in-process engine's step time goes"),
    "roofline": ("roofline.py", "a decode step against the bytes it must read"),
    "grammar-overhead": ("grammar_overhead.py", "grammar masks' share of a decode step"),
    "grammar-mask-cost": ("grammar_mask_cost.py", "llguidance against xgrammar, per token"),
    "llamacpp-reference": ("make_llamacpp_reference.py", "llama.cpp's greedy tokens, for tests"),
    "gpu-check": ("gpu_check.py", "the GPU tests and figures (on a GPU machine)"),
}


def script_path(script: str, repo: Path = REPO) -> Path | None:
    """``bench/<script>`` of the source checkout kvpark runs from, or None outside one."""
    path = repo / "bench" / script
    return path if path.is_file() else None


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


def run_script(script: str, args: list[str]) -> int:
    """Run ``bench/<script> args`` in this interpreter; its exit status, 2 outside a checkout."""
    path = script_path(script)
    if path is None:
        print(
            f"kvpark bench: bench/{script} is part of kvpark's source checkout, not of the "
            f"installed package; run this from a checkout ({REPO} has none)",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, str(path), *args])


def main(scenario: str, argv: list[str]) -> int:
    script, _ = SCRIPTS[scenario]
    return run_script(script, without_scenario(argv))
