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
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from kvpark.config.layers import EngineConfig
from kvpark.engine.add_batches import AddBatches
from kvpark.engine.embeddings import EmbedJob, check_embedding, embed_member
from kvpark.engine.llm_engine import LLMEngine, RequestRejected
from kvpark.engine.outputs import ErrorEvent, FinishedEvent, QueuedEvent, StreamEvent
from kvpark.engine.props import describe_props
from kvpark.engine.slots import describe_slots
from kvpark.engine.stats import EngineStats
from kvpark.runner.protocol import Runner, RunnerFactory
from kvpark.sampling.params import SamplingParams
from kvpark.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("kvpark.engine.llm_engine")
IDLE_WAIT_S = 0.5

_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[list[StreamEvent]]"]
_Delivery = tuple["asyncio.Queue[list[StreamEvent]]", list[StreamEvent]]


def device_type(config: EngineConfig) -> str:
    """Where the built-in runners put the model for ``config`` (``cpu``, ``cuda``): what the
    server decides its process habits by before the model loads (server/process_memory.py)."""
    from kvpark.runner.devices import device_kind  # torch only where a GPU may be

    return device_kind(config.model.device)


class AsyncEngine:
    def __init__(self, config: EngineConfig, runner: Runner | RunnerFactory | None = None) -> None:
        """``runner`` as for ``LLMEngine``; it is built on the engine thread when a factory."""
        self.config = config
        self._runner = runner
        self.ready = False
        self.load_error: str | None = None
        self._engine: LLMEngine | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._slots: list[dict[str, object]] = []
        self._queued: dict[str, int] = {}  # request id -> place in the wait queue (published)
        self._announced: set[str] = set()  # waiting requests told so (engine thread only)
        self._adds = AddBatches(lambda batch: self._post("add", batch))  # one item per tick
        self._embeds: collections.deque[EmbedJob] = collections.deque()  # engine thread only

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="kvpark-engine", daemon=True)
        self._thread.start()

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
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

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
        self._streams[request_id] = (loop, events)
        self._adds.hold(loop, (request_id, list(prompt_ids), params))
        done = False
        try:
            while not done:
                for event in await events.get():
                    yield event
                    if isinstance(event, FinishedEvent | ErrorEvent):
                        done = True
        finally:
            self._streams.pop(request_id, None)
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

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    # ----------------------------------------------------------------- read-only views
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

    # ----------------------------------------------------------------- engine thread
    def _main(self) -> None:
        try:
            self._engine = LLMEngine(self.config, self._runner)
        except Exception as e:
            log.exception("loading the model failed")
            self.load_error = f"{type(e).__name__}: {e}"
            return
        self._slots = describe_slots(self._engine)
        self.ready = True
        while not self._stop.is_set():
            self._drain_inbox()
            self._embed_one()
            if self._engine.has_work:
                try:
                    events = self._engine.step()
                except Exception:
                    log.exception("engine step failed; failing the requests in flight")
                    events = self._fail_all()
                self._announce_queue(events)
                self._dispatch(events)
                self._slots = describe_slots(self._engine)
            elif not self._embeds:
                self._slots = describe_slots(self._engine)
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
        for job in self._embeds:  # shutdown: nobody is left to run them
            job.settle(RuntimeError("the engine stopped"))
        self._engine.close()  # shutdown: copies in flight land, then every cell and buffer is freed

    def _drain_inbox(self) -> None:
        assert self._engine is not None
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                for request_id, prompt_ids, params in payload:
                    try:
                        self._engine.add_request(request_id, prompt_ids, params)
                    except RequestRejected as e:  # the queue is full: refused before any event
                        self._dispatch({request_id: [ErrorEvent(e.message, e.code, e.kind)]})
            elif kind == "abort":
                self._engine.abort(payload)
            elif kind == "embed":
                self._embeds.append(payload)

    def _embed_one(self) -> None:
        """One prompt of the oldest embedding job (a turn of the loop: then a step runs)."""
        if not self._embeds:
            return
        assert self._engine is not None
        embed = embed_member(self._engine.runner)
        assert embed is not None  # check_embedding refused the job otherwise
        try:
            done = self._embeds[0].run_next(embed)
        except Exception:
            log.exception("an embedding failed; its request gets a 500")
            done = True
        if done:
            self._embeds.popleft()

    def _announce_queue(self, events: dict[str, list[StreamEvent]]) -> None:
        """Publish the wait queue's places; tell each request the step left waiting, once.

        Only after a step: a request that the step admitted never hears it was queued.
        """
        assert self._engine is not None
        places = {req.request_id: i for i, req in enumerate(self._engine.scheduler.waiting, 1)}
        for request_id, place in places.items():
            if request_id not in self._announced:
                events.setdefault(request_id, []).insert(0, QueuedEvent(place))
        self._announced = set(places)  # a request never re-enters the queue once it has left
        self._queued = places

    def _fail_all(self) -> dict[str, list[StreamEvent]]:
        assert self._engine is not None
        failed: dict[str, list[StreamEvent]] = {}
        for request_id in list(self._streams):
            try:
                self._engine.abort(request_id)
            except Exception:  # the engine's own state is what broke: the client still hears
                log.exception("aborting %s after a failed step failed too", request_id)
            failed[request_id] = [ErrorEvent("internal error while running the model", 500)]
        return failed

    def _dispatch(self, events: dict[str, list[StreamEvent]]) -> None:
        """Hand one step's events to their streams: one wake-up of each event loop per step, not
        one per request (each wake-up is a write to the loop's self-pipe and a turn of it)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Delivery]] = {}
        for request_id, batch in events.items():
            target = self._streams.get(request_id)
            if target is None:
                continue  # the client is gone; its abort is already queued
            loop, q = target
            by_loop.setdefault(loop, []).append((q, batch))
        for loop, deliveries in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that event loop is closed
                loop.call_soon_threadsafe(_deliver, deliveries)


def _deliver(deliveries: list[_Delivery]) -> None:
    """On the event loop: each stream's batch into its queue."""
    for q, batch in deliveries:
        q.put_nowait(batch)
