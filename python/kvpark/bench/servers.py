"""A server for the length of a ``with`` block: ``managed_server`` starts a command in its own
process group, waits a bounded time for a URL to answer 200, and stops the group on exit; and
the ``kvpark serve`` command line the suites start (a subprocess: the bench stays a client).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx


def kvpark_serve_command(model: str, port: int, *flags: str) -> list[str]:
    """``python -m kvpark serve`` of ``model`` on ``127.0.0.1:port`` with ``flags``, here."""
    cmd = [sys.executable, "-m", "kvpark", "serve", "--model", model, "--host", "127.0.0.1"]
    return [*cmd, "--port", str(port), *flags]


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
    cmd: list[str],
    ready_url: str,
    log_path: Path,
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` (output to ``log_path``; ``env`` replaces the environment when given) until
    the block ends; it must answer ``ready_url``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
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
