"""What the suites that measure kvpark against llama.cpp's servers share (``cpu-comparison``,
``quant-types``): each server's command line from the same flags (the same GGUF, threads, slots and
KV capacity), which of them can run, and a server started for a block of work while its process
tree's peak resident memory is sampled (``peak_rss``), with the load average around the work and
what its ``GET /props`` says ran.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpark.bench.machine import load_average
from kvpark.bench.peak_rss import PeakMemory, PeakRss
from kvpark.bench.peers import llama_server_command, peer_command
from kvpark.bench.servers import kvpark_serve_command, managed_server

PROPS = ("cpu", "build_info", "total_slots")  # which kernels (kvpark: which runner), which build


def server_props(url: str) -> dict[str, Any]:
    """The parts of a server's ``GET /props`` that say what ran ({} where it has none)."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        answer = httpx.get(url + "/props", timeout=10.0, trust_env=False)
        if answer.status_code == 200 and isinstance(body := answer.json(), dict):
            return {key: body[key] for key in PROPS if key in body}
    return {}


def commands(
    args: argparse.Namespace, names: list[str], model: str | None = None
) -> dict[str, tuple[list[str], str]]:
    """name -> (command, readiness path) of each server to measure, in measuring order, on
    ``model`` (default ``args.model``)."""
    gguf = model or args.model
    out: dict[str, tuple[list[str], str]] = {}
    for name in names:
        if name == "llama-server":
            cmd = llama_server_command(
                str(args.llama_server), gguf, args.threads, args.port, args.kv_cells,
                args.parallel, args.llama_server_poll,
            )  # fmt: skip
            out[name] = (cmd + args.llama_server_arg, "/health")
        elif name == "llama-cpp-python":
            cmd = peer_command(gguf, args.threads, args.port, args.kv_cells, args.peer_python)
            out[name] = (cmd, "/v1/models")
        else:
            flags = ["--parallel", str(args.parallel), "--threads", str(args.threads)]
            flags += ["--kv-cells", str(args.kv_cells), *args.kvpark_arg]
            out[name] = (kvpark_serve_command(gguf, args.port, *flags), "/health")
    return out


def available(
    llama_server: Path, peer_python: str, names: list[str], asked: bool
) -> list[str] | int:
    """The servers that can run; exit status 2 (with the reason) when one that must is missing."""
    if "llama-server" in names and not llama_server.is_file():
        print(f"llama-server is not built at {llama_server}: run "
              "`kvpark bench build-llama-server`, or add --build-peer "
              "(or give --llama-server PATH)")  # fmt: skip
        return 2
    if "llama-cpp-python" in names and not Path(peer_python).is_file():
        reason = (
            f"llama-cpp-python: {peer_python} is missing (python3 -m venv /work/peer-venv"
            " && /work/peer-venv/bin/pip install 'llama-cpp-python[server]')"
        )
        if asked:
            print(reason)
            return 2
        print(f"skipping {reason}")
        names = [n for n in names if n != "llama-cpp-python"]
    return names


@dataclass
class Measured:
    """One server's life: its 1-minute load average before and after the work, its props, and the
    peak memory of its process tree over the work (set when the block ends)."""

    load: list[float] = field(default_factory=list)
    props: dict[str, Any] = field(default_factory=dict)
    peak: PeakMemory | None = None

    @property
    def peak_mib(self) -> float:
        assert self.peak is not None, "read after the block"
        return self.peak.peak_mib


@contextlib.contextmanager
def measured_server(cmd: list[str], url: str, ready: str, log: Path) -> Iterator[Measured]:
    """``cmd`` serving ``url`` (ready when ``url + ready`` answers 200, output to ``log``) for the
    block, its memory sampled throughout; the peak is read before the server stops (a dead
    process has no ``VmHWM``)."""
    measured = Measured()
    with managed_server(cmd, url + ready, log, timeout_s=600.0) as process:
        measured.load.append(load_average())
        with PeakRss(process.pid) as peak:
            yield measured
        measured.load.append(load_average())
        measured.props = server_props(url)
    measured.peak = peak.result
