"""A viewer of ``GET /v1/pool/events`` for the tests: a thread that reads the stream and keeps
every event (the snapshot, the deltas), the raw bytes, and the page owners as the events say they
are now."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any

import httpx

from support.servers import Server


class PoolViewer:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.raw = bytearray()
        self.owners: list[int] = []
        self.status: int | None = None
        self.ended = threading.Event()
        self._socket: socket.socket | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> PoolViewer:
        self._thread.start()
        self.wait_for("a first snapshot", lambda: bool(self.events))
        return self

    def _read(self) -> None:
        # a plain socket, so close() can end the read at once (shutdown wakes a blocked recv)
        url = httpx.URL(self.server.base_url)
        self._socket = socket.create_connection((url.host, url.port or 80), timeout=60)
        auth = "".join(f"{k}: {v}\r\n" for k, v in self.server.headers.items())
        request = f"GET /v1/pool/events HTTP/1.1\r\nHost: {url.host}\r\n{auth}\r\n"
        self._socket.sendall(request.encode())
        stream = self._socket.makefile("rb")
        try:
            self.status = int(stream.readline().split()[1])
            while stream.readline() not in (b"\r\n", b""):
                pass  # the headers
            pending = b""
            name = "message"
            while size := int(stream.readline().strip() or b"0", 16):  # chunked, as uvicorn sends
                pending += stream.read(size)
                stream.readline()
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self.raw += line + b"\n"
                    text = line.decode()
                    if text.startswith("event: "):
                        name = text.removeprefix("event: ")
                    elif text.startswith("data: "):
                        self._apply(name, json.loads(text.removeprefix("data: ")))
        except (OSError, ValueError):
            pass  # closed by close(), from another thread
        finally:
            self.ended.set()

    def _apply(self, name: str, body: dict[str, Any]) -> None:
        if name == "snapshot":
            self.owners = [0] * body["pool"]["pages"]
        for first, count, owner in body.get("pages", []):
            self.owners[first : first + count] = [owner] * count
        self.events.append((name, body))

    def deltas(self) -> list[dict[str, Any]]:
        return [body for name, body in self.events if name == "delta"]

    def wait_for(self, what: str, check: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"no {what} within {timeout} s: {self.events}"
            assert not self.ended.is_set() or check(), f"the stream ended before {what}"
            time.sleep(0.02)

    def close(self) -> None:
        """Hang up, as a browser tab that closes does."""
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
        assert self.ended.wait(10), "the reader did not stop"
        if self._socket is not None:
            self._socket.close()
