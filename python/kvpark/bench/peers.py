"""Start the peer servers for comparisons, on a GGUF, on 127.0.0.1: llama.cpp's ``llama-server``
(the baseline) and llama-cpp-python's OpenAI server (a second peer).

    python bench/peer_llamacpp.py --model path/to/model.gguf --threads 2 --port 8101
    python bench/peer_llamacpp.py --llama-server --model path/to/model.gguf --threads 2

``llama-server`` is built once by ``bench/build_llama_server.py`` into a cache outside the
repository (``default_llama_server()``); it batches every slot's tokens into one decode
(continuous batching).
llama-cpp-python lives in its own virtual environment (``/work/peer-venv`` by default; ``--python``
to change it), installed with ``pip install 'llama-cpp-python[server]'`` (builds llama.cpp again).
It serves one request at a time; ``interrupt_requests`` is turned off so that a new request waits
for the running one instead of cutting it short (the default would truncate concurrent streams).

``managed_server`` (used by ``run_cpu_comparison.py`` for kvpark as well) starts a command in its
own process group, waits a bounded time for a URL to answer 200, and stops the group on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from build_llama_server import BINARY, DEFAULT_VERSION, default_cache

DEFAULT_PEER_PYTHON = "/work/peer-venv/bin/python"


def default_llama_server() -> Path:
    """Where ``bench/build_llama_server.py`` puts the binary by default (it may not exist yet)."""
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
    """What is known of a llama-server binary: the build record ``build_llama_server.py`` wrote
    next to it (llama.cpp's tag, cmake flags), and its own ``--version`` output."""
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


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Poll ``url`` until it answers 200; raise if the process exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before answering {url}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s")


@contextlib.contextmanager
def managed_server(
    cmd: list[str], ready_url: str, log_path: Path, timeout_s: float = 300.0
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` (output to ``log_path``) until the block ends; it must answer ``ready_url``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_ready(ready_url, process, timeout_s)
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # its own group: the server and its children
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--python", default=DEFAULT_PEER_PYTHON, help="the peer venv's python")
    p.add_argument(
        "--llama-server", nargs="?", const=str(default_llama_server()), default=None,
        metavar="PATH", help="start llama-server (default binary: build_llama_server.py's cache)",
    )  # fmt: skip
    p.add_argument("--parallel", type=int, default=16, help="llama-server's slots (-np)")
    p.add_argument("--poll", type=int, default=0, help="llama-server's --poll (its default: 50)")
    args = p.parse_args(argv)
    if args.llama_server:
        cmd = llama_server_command(
            args.llama_server, args.model, args.threads, args.port, args.n_ctx, args.parallel,
            args.poll,
        )  # fmt: skip
    else:
        cmd = peer_command(args.model, args.threads, args.port, args.n_ctx, args.python)
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
