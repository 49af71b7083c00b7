"""Stored responses of ``/v1/responses`` (``store``), in memory, bounded in count, bytes and time.

OpenAI's convention: a response made with ``store`` (true unless the request says otherwise,
while the store is on) can be read back (``GET /v1/responses/{id}``), continued
(``previous_response_id``), and, made with ``background``, streamed again and cancelled
(server/responses_kept.py). Here they live in this process's memory only:

- at most ``--response-store`` responses and ``--response-store-mib`` MiB (a response's bytes:
  its object, its conversation and, for a background one, its logged events); past either, the
  oldest finished ones are forgotten first. A running background response is never forgotten
  (it finishes, or is cancelled, first), so it may take the store over its bounds while it runs;
- a finished response is forgotten ``--response-store-ttl`` seconds after it finished (0: only
  the bounds push it out);
- with API keys, only the key that made a response finds it; any other gets the 404 an unknown
  id gets, so ids cannot be probed. Ids carry 128 random bits (server/pipeline.py).

Route handlers run on the event loop and ``previous_response_id`` is looked up on a worker thread
(where bodies are parsed), so every access takes the lock.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpark.server.errors import APIError
from kvpark.server.responses import JSON
from kvpark.server.stream_log import StreamLog

MIB = 2**20


@dataclass
class StoredResponse:
    response_id: str
    owner: bytes | None  # the digest of the API key that made it (None: no keys)
    background: bool
    # the conversation up to and with this response, as validated input items: what a request
    # naming it as previous_response_id continues (set when it finishes)
    items: tuple[object, ...] = ()
    final: JSON | None = None  # the response object once it has finished (or failed, or...)
    live: Callable[[str], JSON] | None = None  # the object so far, by status, while it runs
    log: StreamLog | None = None  # a background response's events, for ?stream=true
    task: asyncio.Task[None] | None = None  # a background response's producer
    cancelled: bool = False  # POST .../cancel (or DELETE, or a shutdown) stopped it
    settle: Callable[[], None] | None = None  # ends a background one its producer left running
    size: int = 0  # bytes of ``final`` and ``items`` as JSON
    finished_at: float | None = None

    @property
    def running(self) -> bool:
        return self.final is None

    def current(self) -> JSON:
        """The response as it stands: final, or in progress (queued before its first event)."""
        if self.final is not None:
            return self.final
        assert self.live is not None
        started = self.log is not None and self.log.started
        return self.live("in_progress" if started else "queued")

    def bytes(self) -> int:
        return self.size + (self.log.bytes if self.log is not None else 0)


def json_size(objects: Sequence[object]) -> int:
    """What ``objects`` take as JSON: the store's measure of a response."""
    total = 0
    for obj in objects:
        dump = getattr(obj, "model_dump_json", None)
        total += len(dump() if dump is not None else json.dumps(obj, ensure_ascii=False))
    return total


class ResponseStore:
    def __init__(
        self,
        max_count: int,
        max_bytes: int,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_count = max_count  # 0: nothing is stored
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_count > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(record.bytes() for record in self._records.values())

    def add(self, record: StoredResponse) -> None:
        """Keep ``record``: a running background response, or a finished one."""
        if record.final is not None:
            record.size = json_size([record.final, *record.items])
            record.finished_at = self.clock()
        with self._lock:
            self._records[record.response_id] = record
            self._trim()

    def finish(self, record: StoredResponse, final: JSON, items: tuple[object, ...]) -> None:
        """A running (background) response has finished: its object and conversation."""
        with self._lock:
            record.final, record.items = final, items
            record.size = json_size([final, *items])
            record.finished_at = self.clock()
            self._trim()

    def get(
        self, response_id: str, key: bytes | None, param: str = "response_id"
    ) -> StoredResponse:
        """The response; 404 for an unknown, expired or forgotten id, or another key's."""
        with self._lock:
            self._trim()
            record = self._records.get(response_id)
        same_key = record is not None and (
            record.owner is None or (key is not None and hmac.compare_digest(record.owner, key))
        )
        if record is None or not same_key:
            raise APIError(
                404,
                f"no stored response {response_id!r} (unknown, expired, or not stored)",
                param=param,
            )
        return record

    def remove(self, response_id: str) -> None:
        with self._lock:
            self._records.pop(response_id, None)

    def running(self) -> list[StoredResponse]:
        with self._lock:
            return [record for record in self._records.values() if record.running]

    def _trim(self) -> None:
        """Forget what has outlived the time to live, then the oldest finished responses while
        the store is over its count or its bytes. Under the lock."""
        now = self.clock()
        for response_id, record in list(self._records.items()):
            ended = record.finished_at
            if self.ttl > 0 and ended is not None and now - ended >= self.ttl:
                del self._records[response_id]
        held = sum(record.bytes() for record in self._records.values())
        for response_id, record in list(self._records.items()):
            if len(self._records) <= self.max_count and held <= self.max_bytes:
                break
            if not record.running:
                del self._records[response_id]
                held -= record.bytes()
