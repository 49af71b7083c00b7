"""The flags every suite shares (``--model``, ``--threads``, ``--out``, ``--name``, ``--seed``)
and those of a suite with a llama.cpp peer (``--peer``, ``--llama-server``, ``--build-peer``),
and how a suite finds its peer's binary (building it first when asked).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from kvpark.bench.llama_build import DEFAULT_VERSION, default_cache, ensure
from kvpark.bench.machine import default_model
from kvpark.bench.options import BenchOptions
from kvpark.bench.peers import PEERS, default_llama_server


def suite_parser(scenario: str, description: str, name: str) -> argparse.ArgumentParser:
    """A suite's parser: ``--scenario`` (itself), the shared flags; the suite adds its own."""
    p = argparse.ArgumentParser(prog=f"kvpark bench --scenario {scenario}", description=description)
    p.add_argument("--scenario", choices=[scenario], required=True, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--threads", type=int, default=2, help="every server's threads")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="JSON, PNG, logs")
    p.add_argument("--name", default=name, help=f"file name stem (default {name})")
    return p


def add_peer_flags(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--peer",
        default=None,
        help=f"comma-separated peers to measure besides kvpark, of {', '.join(PEERS)}; "
        f"'none' for kvpark alone (default {default})",
    )
    p.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        metavar="PATH",
        help="the llama-server binary (default: the build-llama-server cache)",
    )
    p.add_argument(
        "--build-peer",
        action="store_true",
        help="build llama-server first when it is missing (kvpark bench build-llama-server)",
    )
    p.add_argument("--build-jobs", type=int, default=os.cpu_count() or 1, help="with --build-peer")


def parse_peers(text: str) -> list[str]:
    """``"llama-server, llama-cpp-python"`` -> the peers in measuring order; ``none`` -> [].
    (``--peer`` defaults to None, so that a suite can tell a peer asked for from its default.)"""
    names = {name.strip() for name in text.split(",") if name.strip()}
    if names == {"none"}:
        return []
    unknown = names - set(PEERS)
    if unknown or not names:
        raise ValueError(f"--peer takes a list of {', '.join(PEERS)} or 'none'; got {text!r}")
    return [name for name in PEERS if name in names]


def llama_server_binary(args: argparse.Namespace) -> Path:
    """``--llama-server``, or the cache's binary, built first under ``--build-peer``."""
    if args.llama_server is not None:
        return Path(args.llama_server)
    if args.build_peer:
        return ensure(DEFAULT_VERSION, default_cache(), args.build_jobs)
    return default_llama_server()


def model_of(args: argparse.Namespace) -> str:
    return str(args.model or default_model())


def checked_options(p: argparse.ArgumentParser, make: Callable[[], BenchOptions]) -> BenchOptions:
    """``make()``, or exit 2 through ``p.error`` when the flags it reads are out of range (before
    any server starts)."""
    try:
        return make()
    except ValueError as exc:
        p.error(str(exc))
