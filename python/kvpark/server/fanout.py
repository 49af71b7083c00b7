"""One HTTP request, several engine requests: run a generator per prompt and merge their events.

Each prompt's engine stream is pumped by its own task into one queue, tagged with the prompt's
index. Readers take events with a timeout (the SSE writer needs to wake up for pings) without ever
cancelling an engine generator mid-step. Leaving the ``async with`` block cancels the pumps, which
closes their generators: that is what aborts the engine requests and gives their cells back when a
client goes away or one prompt fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

from kvpark.engine.outputs import ErrorEvent, StreamEvent
from kvpark.sampling.params import SamplingParams

log = logging.getLogger("kvpark.server")

Generate = Callable[[list[int], SamplingParams, str], AsyncIterator[StreamEvent]]
Timeout = Literal["timeout"]
End = Literal["end"]


@dataclass(frozen=True)
class PromptEvent:
    prompt: int  # index of the prompt in the request
    event: StreamEvent


class FanIn:
    """Merged events of every prompt of one request; use as ``async with FanIn(...) as events``."""

    def __init__(
        self,
        generate: Generate,
        prompts: list[list[int]],
        params: list[SamplingParams],
        request_id: str,
        rejected: type[Exception] | None = None,
        buffer_limit: int = 0,
    ) -> None:
        self._generate = generate
        # events held for a reader that is not taking them (its client stopped reading: stall.py);
        # past this many the engine requests are aborted (0: no bound)
        self._limit = buffer_limit
        self._overflowed = False
        self._jobs = list(zip(prompts, params, strict=True))
        self._request_id = request_id
        self._rejected = rejected
        # events of every prompt in arrival order (None: a prompt's stream ended), and the future
        # a waiting reader sleeps on: a plain future, not a Task per wait
        self._items: deque[PromptEvent | None] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._running = 0

    def choices(self) -> list[int]:
        """Each prompt's number of choices (its ``n``)."""
        return [params.n for _, params in self._jobs]

    def engine_request_id(self, prompt: int) -> str:
        return self._request_id if len(self._jobs) == 1 else f"{self._request_id}-{prompt}"

    async def __aenter__(self) -> FanIn:
        for i, (prompt, params) in enumerate(self._jobs):
            self._tasks.append(asyncio.create_task(self._pump(i, prompt, params)))
        self._running = len(self._tasks)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for task in self._tasks:
            task.cancel()
        # Shielded so a cancelled reader still waits for the generators to close (and abort).
        await asyncio.shield(asyncio.gather(*self._tasks, return_exceptions=True))

    async def next(self, timeout: float | None) -> PromptEvent | Timeout | End:
        """The next event of any prompt; ``"timeout"`` after ``timeout`` s; ``"end"`` at the end."""
        while True:
            if self._running == 0 and not self._items:
                return "end"
            item = await self._get(timeout)
            if item == "timeout" or item is not None:
                return item
            self._running -= 1

    def _put(self, item: PromptEvent | None) -> None:
        if self._overflowed and item is not None:
            return  # after the overflow's error only the ends of the streams come
        if item is not None and self._limit > 0 and len(self._items) >= self._limit:
            self._overflow(item.prompt)
            return
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _get(self, timeout: float | None) -> PromptEvent | Timeout | None:
        # Not asyncio.wait_for: before Python 3.12 it returns the result instead of raising when
        # it is cancelled just as an item arrives, and a lost cancellation after a disconnect
        # would keep an endless stream running. A cancelled wait leaves every item in place.
        if not self._items:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            # a timer on the future itself, not asyncio.wait's set, callbacks and second future
            # per event (one in twenty of the event loop's time at eight streamed chats)
            timer = None if timeout is None else loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not self._items:
                return "timeout"
        return self._items.popleft()

    async def _pump(self, prompt: int, ids: list[int], params: SamplingParams) -> None:
        stream = self._generate(ids, params, self.engine_request_id(prompt))
        try:
            async for event in stream:
                self._put(PromptEvent(prompt, event))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._put(PromptEvent(prompt, self._as_error(exc)))
        finally:
            try:  # aclose() runs the generator's own cleanup, which aborts the engine request
                if isinstance(stream, AsyncGenerator):
                    await stream.aclose()
            finally:
                self._put(None)

    def _overflow(self, prompt: int) -> None:
        log.warning(
            "stream %s aborted: %d events unread (--stream-buffer)", self._request_id, self._limit
        )
        self.give_up(f"stream buffer full: the client did not read {self._limit} events", prompt)

    def give_up(self, message: str, prompt: int = 0) -> None:
        """A buffer is full (this one, or a reattachable stream's log): cancel every pump
        (closing its generator aborts its engine request, so its cells and parked bytes come
        back now) and end with a 503 error, which the reader gets after what it has not read
        yet, should it ever read again."""
        if self._overflowed:
            return
        self._overflowed = True
        self._items.append(PromptEvent(prompt, ErrorEvent(message, 503, "unavailable_error")))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        for task in self._tasks:
            task.cancel()

    def _as_error(self, exc: Exception) -> ErrorEvent:
        if self._rejected is not None and isinstance(exc, self._rejected):
            return ErrorEvent(
                str(getattr(exc, "message", exc)),
                int(getattr(exc, "code", 400)),
                str(getattr(exc, "kind", "invalid_request_error")),
            )
        log.error("engine stream of %s failed", self._request_id, exc_info=exc)
        return ErrorEvent(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")


def _wake(waiter: asyncio.Future[None]) -> None:
    """The wait's timeout: the reader wakes with no item."""
    if not waiter.done():
        waiter.set_result(None)
