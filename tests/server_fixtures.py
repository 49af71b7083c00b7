"""A real ``kvpark serve`` in a subprocess on 127.0.0.1, for the server tests.

Each test module starts its own server (module-scoped fixture), waits for ``/health`` 200 and kills
it at teardown. Small pool, float32, one thread, so the suite stays fast on two shared cores.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

import kvpark

STARTUP_TIMEOUT_S = (
    300.0  # loading takes ~10 s alone; much longer while other suites share the cores
)
# every /slots entry has exactly these fields (SPEC §3.3)
SLOT_FIELDS = {
    "id",
    "state",
    "is_preempted",
    "is_transferring",
    "n_preempt",
    "n_recompute",
    "n_prompt_tokens",
    "n_cells",
    "n_decoded",
}
TEST_FLAGS = ("--dtype", "float32", "--threads", "1", "--kv-cells", "4096", "--parallel", "4")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def metric(self, name: str) -> float:
        """The value of an unlabelled metric from /metrics."""
        text = httpx.get(f"{self.base_url}/metrics", headers=self.headers, timeout=30).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics")

    def wait_for_log(self, needle: str, timeout: float = 60.0) -> str:
        """Poll the log until it contains ``needle``; the log then."""
        deadline = time.monotonic() + timeout
        while needle not in (text := self.log()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert needle in text, f"{needle!r} not in the server log after {timeout} s:\n{text}"
        return text

    def wait_cells_free(self, timeout: float = 60.0) -> None:
        """Poll /metrics until no cell is held (the engine frees an aborted request's cells)."""
        deadline = time.monotonic() + timeout
        used = self.metric("kvpark_kv_cells_used")
        while used != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            used = self.metric("kvpark_kv_cells_used")
        assert used == 0, f"kvpark_kv_cells_used is still {used} after {timeout} s"


def start_server(
    *extra: str,
    api_key: str | None = None,
    environ: dict[str, str] | None = None,
    port: int | None = None,
) -> Server:
    """``port``: a fixed one (the README's 8000); None: a free one."""
    port = free_port() if port is None else port
    fd, log_name = tempfile.mkstemp(prefix="kvpark-server-", suffix=".log")
    package_root = str(Path(kvpark.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        **(environ or {}),
        "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]),
    }
    args = [sys.executable, "-m", "kvpark", "serve", "--host", "127.0.0.1", "--port", str(port)]
    args += [*TEST_FLAGS, *extra]
    if api_key is not None:
        args += ["--api-key", api_key]
    with os.fdopen(fd, "wb") as log_file:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    server = Server(f"http://127.0.0.1:{port}", process, Path(log_name), api_key, headers)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvpark serve exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    stop_server(server)
    raise RuntimeError(f"kvpark serve was not ready after {STARTUP_TIMEOUT_S} s:\n{server.log()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(timeout=20)
    server.log_path.unlink(missing_ok=True)


def serve_for_module(
    *extra: str,
    api_key: str | None = None,
    environ: dict[str, str] | None = None,
    port: int | None = None,
) -> Iterator[Server]:
    """Body of a module-scoped fixture: ``yield from serve_for_module(...)``."""
    server = start_server(*extra, api_key=api_key, environ=environ, port=port)
    try:
        yield server
    finally:
        stop_server(server)


def sse_lines(response: httpx.Response) -> list[str]:
    """The non-empty lines of an SSE body, in order (data lines and comments)."""
    return [line for line in response.iter_lines() if line]


def sse_data(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON objects of the data lines, [DONE] excluded."""
    objects = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            objects.append(json.loads(line[len("data: ") :]))
    return objects
