"""The one way the tests start a real ``kvpark serve``: a subprocess on 127.0.0.1, ready once
``/health`` answers 200, stopped (terminate, then kill) at the end.

Most server tests start theirs from a module-scoped fixture (:func:`serve_for_module`); the others
use :func:`serving` or :func:`start_server` / :func:`stop_server`, and :func:`launch_server` /
:func:`wait_healthy` start several at once so their loading overlaps. By default a server gets
:data:`TEST_FLAGS` (small pool, float32, one thread, so the suite stays fast on two shared cores)
before the caller's flags, which win.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.types import ASGIApp

import kvpark
from support.metrics import scrape

STARTUP_TIMEOUT_S = (
    300.0  # loading takes ~10 s alone; much longer while other suites share the cores
)
# every /slots entry has exactly these fields (docs/server.md, "GET /slots")
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
    owns_log: bool = True  # a temporary log, removed when the server stops

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics (see :func:`support.metrics.parse_metrics`)."""
        return scrape(self.base_url, self.headers)

    def metric(self, name: str) -> float:
        """The value of an unlabelled metric from /metrics."""
        samples = self.metrics()
        if name not in samples:
            raise AssertionError(f"{name} not in /metrics")
        return samples[name]

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


def launch_server(
    *extra: str,
    api_key: str | None = None,
    environ: dict[str, str] | None = None,
    port: int | None = None,
    base_flags: Sequence[str] = TEST_FLAGS,
    log_path: Path | None = None,
) -> Server:
    """Start ``kvpark serve`` without waiting for it. ``port``: a fixed one (the README's 8000);
    None: a free one. ``base_flags`` go before ``extra``. ``log_path``: where its output goes (kept
    when it stops); None: a temporary file, removed when it stops."""
    port = free_port() if port is None else port
    if log_path is None:
        fd, log_name = tempfile.mkstemp(prefix="kvpark-server-", suffix=".log")
        log_file = os.fdopen(fd, "wb")
        log_path, owns_log = Path(log_name), True
    else:
        log_file, owns_log = log_path.open("wb"), False
    package_root = str(Path(kvpark.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        **(environ or {}),
        "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]),
    }
    args = [sys.executable, "-m", "kvpark", "serve", "--host", "127.0.0.1", "--port", str(port)]
    args += [*base_flags, *extra]
    if api_key is not None:
        args += ["--api-key", api_key]
    with log_file:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return Server(f"http://127.0.0.1:{port}", process, log_path, api_key, headers, owns_log)


def wait_healthy(server: Server, timeout: float = STARTUP_TIMEOUT_S) -> Server:
    """Poll ``/health`` until it answers 200; stop the server and raise if it exits first or
    ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            code = server.process.returncode
            log = server.log()
            stop_server(server)
            raise RuntimeError(f"kvpark serve exited with {code}:\n{log}")
        try:
            url = f"{server.base_url}/health"
            if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    log = server.log()
    stop_server(server)
    raise RuntimeError(f"kvpark serve was not ready after {timeout} s:\n{log}")


def start_server(
    *extra: str,
    api_key: str | None = None,
    environ: dict[str, str] | None = None,
    port: int | None = None,
    base_flags: Sequence[str] = TEST_FLAGS,
    log_path: Path | None = None,
    timeout: float = STARTUP_TIMEOUT_S,
) -> Server:
    """:func:`launch_server`, then :func:`wait_healthy`."""
    server = launch_server(
        *extra,
        api_key=api_key,
        environ=environ,
        port=port,
        base_flags=base_flags,
        log_path=log_path,
    )
    return wait_healthy(server, timeout)


def stop_server(*servers: Server) -> None:
    """Terminate every one, then wait for each (killing one that does not end)."""
    for server in servers:
        server.process.terminate()
    for server in servers:
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=20)
        if server.owns_log:
            server.log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def serving(*extra: str, **options: Any) -> Iterator[Server]:
    """``with serving(...) as server:`` a :func:`start_server` (same arguments), stopped at the
    end."""
    server = start_server(*extra, **options)
    try:
        yield server
    finally:
        stop_server(server)


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


@contextlib.contextmanager
def app_in_thread(app: ASGIApp) -> Iterator[str]:
    """An ASGI app (a fake server) on uvicorn in a thread, on a free port; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "the fake server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
