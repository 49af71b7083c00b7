"""The engine on its own thread, for asyncio callers (the server, embedding applications).

::

    asyncio side (any loop)                 engine thread (single owner of the pool)
    generate() ── inbox: add/abort ───────► drain inbox → step() → events
        ▲                                        │
        └──── per-request asyncio.Queue ◄────────┘ one loop.call_soon_threadsafe a step

Closing a ``generate()`` iterator early (client gone, cancellation) aborts the request, which frees
its cells at the start of the engine's next step.

Admission happens on the engine thread: ``LLMEngine.add_request`` refuses a request past
``--max-waiting`` (its only event is then a 503 ``ErrorEvent``). The adds one event-loop tick makes
(every prompt of a multi-prompt request) reach the engine thread as one inbox item, so they are
admitted or refused together, before any of them runs a step. After each step, a request still
waiting that has not been told gets a ``QueuedEvent`` as its first event, and
:meth:`AsyncEngine.queue_position` reports its current place until it leaves the queue.

``embed()`` posts an embedding job the same way; the loop runs one of its prompts per turn, between
steps, so the model is never used by two things at once (engine/embeddings.py).

The thread itself, and how it is supervised (a failed step fails only its own requests; a failed
or wedged thread ends the engine, :meth:`~EngineThread.health` says why), are
engine/engine_thread.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from kvpark.config.layers import EngineConfig
from kvpark.engine.embeddings import EmbedJob, check_embedding
from kvpark.engine.engine_thread import FAILED, EngineThread
from kvpark.engine.llm_engine import LLMEngine, RequestRejected
from kvpark.engine.outputs import ErrorEvent, FinishedEvent, StreamEvent
from kvpark.engine.pool_view import PoolFeed
from kvpark.engine.props import describe_props
from kvpark.engine.stats import EngineStats
from kvpark.sampling.params import SamplingParams
from kvpark.tokenizer.tokenizer import Tokenizer


def device_type(config: EngineConfig) -> str:
    """Where the built-in runners put the model for ``config`` (``cpu``, ``cuda``): what the
    server decides its process habits by before the model loads (server/process_memory.py)."""
    from kvpark.runner.devices import device_kind  # torch only where a GPU may be

    return device_kind(config.model.device)


class AsyncEngine(EngineThread):
    # ----------------------------------------------------------------- lifecycle
    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until loaded (or failed); True when ready."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready and self.load_error is None:
            if self._thread is None or not self._thread.is_alive():
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            self._thread.join(0.05)
        return self.ready

    async def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self.failure is None:  # a wedged thread never ends
            await asyncio.to_thread(self._thread.join, 30.0)

    def end_streams(self, message: str) -> list[str]:
        """Shutdown's deadline: every open stream ends now with a 503 ``message`` and its engine
        request is aborted; the request ids."""
        self._ended = message  # and a request on its way in is refused with it
        ended = self._streams.end_all(ErrorEvent(message, 503, "unavailable_error"))
        for request_id in ended:
            self._post("abort", request_id)
        return ended

    def _refusal(self) -> str | None:
        if self.failure is not None:
            return FAILED + self.failure
        return self._ended

    @property
    def open_requests(self) -> int:
        """Engine requests with an open stream."""
        return len(self._streams)

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("the model is still loading")
        return self._engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    # ----------------------------------------------------------------- requests
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.check_request(prompt_ids, params)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[StreamEvent]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[list[StreamEvent]] = asyncio.Queue()
        if request_id in self._streams:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        self._streams.open(request_id, loop, events)
        refusal = self._refusal()  # after open(): an ending either sees this stream or is seen
        if refusal is not None:
            self._streams.close(request_id)
            yield ErrorEvent(refusal, 503, "unavailable_error")
            return
        self._adds.hold(loop, (request_id, list(prompt_ids), params))
        done = False
        try:
            while not done:
                for event in await events.get():
                    yield event
                    if isinstance(event, FinishedEvent | ErrorEvent):
                        done = True
        finally:
            self._streams.close(request_id)
            if not done:
                self.abort(request_id)

    def check_embedding(self, prompts: list[list[int]]) -> None:
        """``RequestRejected`` unless :meth:`embed` can take ``prompts`` (engine/embeddings.py)."""
        engine = self.engine
        check_embedding(engine.runner, prompts, engine.vocab_size, engine.max_model_len)

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """Each prompt's embedding (the runner's ``embed``), computed on the engine thread between
        steps; checked first with :meth:`check_embedding`. Cancelling the await drops the prompts
        not yet run."""
        self.check_embedding(prompts)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[list[float]]] = loop.create_future()
        self._post("embed", EmbedJob(loop, future, [list(p) for p in prompts]))
        return await future

    def abort(self, request_id: str) -> None:
        self._adds.flush(None)  # an add still held back must reach the engine before its abort
        self._post("abort", request_id)

    # ----------------------------------------------------------------- read-only views
    def watch_pool(self, feed: PoolFeed) -> None:
        """Send pool snapshots to ``feed`` while it says someone watches, at most one per its
        interval (engine/pool_view.py), and look at it now."""
        self.pool_feed = feed
        self._wake.set()

    def slots(self) -> list[dict[str, object]]:
        return list(self._slots)

    def queue_position(self, request_id: str) -> int | None:
        """1-based place of a request in the wait queue as of the last step; None once it has left
        the queue (or was never in it). Safe from any thread: the dict is replaced, not mutated."""
        return self._queued.get(request_id)

    def props(self) -> dict[str, object]:
        return describe_props(self.config, self._engine if self.ready else None, self.stats())

    def stats(self) -> EngineStats:
        if self._engine is None:
            return EngineStats(kv_cells_total=self.config.pool.kv_cells)
        return replace(self._engine.stats)

    def drain_observations(self) -> dict[str, list[float]]:
        if self._engine is None:
            return {}
        return self._engine.observations.drain()
