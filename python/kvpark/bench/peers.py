"""The peers kvpark is measured against, on a GGUF, on 127.0.0.1: llama.cpp's ``llama-server``
(the baseline) and llama-cpp-python's OpenAI server (a second peer): their command lines and
versions. ``servers.managed_server`` starts them.

``llama-server`` is built once by ``kvpark bench build-llama-server`` into a cache outside the
repository (``default_llama_server()``); it batches every slot's tokens into one decode
(continuous batching). llama-cpp-python lives in its own virtual environment (``/work/peer-venv``
by default), installed with ``pip install 'llama-cpp-python[server]'`` (builds llama.cpp again).
It serves one request at a time; ``interrupt_requests`` is turned off so that a new request waits
for the running one instead of cutting it short (the default would truncate concurrent streams).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvpark.bench.llama_build import BINARY, DEFAULT_VERSION, default_cache

PEERS = ("llama-server", "llama-cpp-python")
DEFAULT_PEER_PYTHON = "/work/peer-venv/bin/python"


def default_llama_server() -> Path:
    """Where ``kvpark bench build-llama-server`` puts the binary by default (it may not exist
    yet)."""
    return default_cache() / DEFAULT_VERSION / BINARY


def llama_server_command(
    binary: str,
    model: str,
    threads: int,
    port: int,
    n_ctx: int,
    parallel: int = 16,
    poll: int = 0,
) -> list[str]:
    """llama-server on ``127.0.0.1:port``: ``parallel`` slots sharing an ``n_ctx``-cell KV cache,
    ``threads`` for decode (``-t``) and for prompts (``-tb``) alike, continuous batching (its
    default). ``--no-webui``: the build has no UI anyway; ``--metrics`` for ``/metrics``.

    ``poll`` is ``--poll``: how hard its compute threads busy-wait for work between graphs
    (llama.cpp's default 50). On 2 cores shared with its own HTTP thread and the bench client,
    polling threads starve both: measured 2026-12-01, one chat at a time streamed 5.6 tok/s with
    ``--poll 50`` (gaps p95 1.2 s) and 59.6 tok/s with ``--poll 0``, the same decode speed inside
    the server. 0 is the peer's better configuration here, so it is the default."""
    return [
        binary, "-m", model, "-np", str(parallel), "-c", str(n_ctx), "-t", str(threads),
        "-tb", str(threads), "--poll", str(poll), "--host", "127.0.0.1", "--port", str(port),
        "--no-webui", "--metrics",
    ]  # fmt: skip


def llama_server_version(binary: str) -> dict[str, object]:
    """What is known of a llama-server binary: the build record ``kvpark bench
    build-llama-server`` wrote next to it (llama.cpp's tag, cmake flags), and its own
    ``--version`` output."""
    info: dict[str, object] = {"binary": binary}
    record = Path(binary).with_name(f"{BINARY}.json")
    if record.is_file():
        info["build"] = json.loads(record.read_text())
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    info["version_output"] = (done.stdout + done.stderr).strip()
    return info


def peer_command(
    model: str, threads: int, port: int, n_ctx: int = 4096, python: str = DEFAULT_PEER_PYTHON
) -> list[str]:
    """The command line of llama-cpp-python's server on ``127.0.0.1:port``.

    ``threads`` sets ``--n_threads`` (decode); ``--n_threads_batch`` (prompt) keeps its default, all
    cores, so ``threads=1`` is the server's default configuration on a 2-core machine.
    """
    return [
        python, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1",
        "--port", str(port), "--n_threads", str(threads), "--n_ctx", str(n_ctx),
        "--interrupt_requests", "False",
    ]  # fmt: skip


def peer_version(python: str = DEFAULT_PEER_PYTHON) -> str:
    """The installed llama-cpp-python version, read from the peer's environment."""
    out = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('llama_cpp_python'))"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return out.stdout.strip()
