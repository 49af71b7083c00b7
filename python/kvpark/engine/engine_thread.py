"""The engine thread of an ``AsyncEngine`` (engine/async_engine.py, the asyncio side): the one
owner of the pool, its loop, and its supervision.

One turn of the loop: the inbox (adds, aborts, embedding jobs), one embedding prompt, one step, the
step's events to their streams (engine/streams.py); an idle wait when there is nothing to do.

Supervised: whatever a step raises (a Python exception, or a Rust panic, which pyo3 raises as a
``BaseException`` that ``except Exception`` lets by) fails only that step's requests, after which
the pool's integrity check runs (engine/step_failures.py); requests waiting or parked behind it
run on. An add or an embedding that raises fails its own request. Anything else that raises on
the thread (the loop's own code, an abort that leaves the pool unsound) ends the engine:
:meth:`EngineThread.fail` records why in :attr:`EngineThread.failure` and gives every open stream a
last 500 ``ErrorEvent``. :meth:`EngineThread.health` reports that, a thread that has gone, and one
that has spent longer than a timeout in one turn of its loop (a wedged step), which the server
then ends from outside with :meth:`EngineThread.fail`.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any

from kvpark.config.env import Knobs
from kvpark.config.layers import EngineConfig
from kvpark.engine.add_batches import AddBatches
from kvpark.engine.embeddings import EmbedJob, embed_member
from kvpark.engine.llm_engine import LLMEngine, RequestRejected, queue_full
from kvpark.engine.outputs import ErrorEvent, QueuedEvent, StreamEvent
from kvpark.engine.pool_view import PoolFeed, PoolView
from kvpark.engine.slots import describe_slots
from kvpark.engine.step_failures import check_pool, fail_step
from kvpark.engine.step_watch import StepWatch
from kvpark.engine.streams import Streams
from kvpark.runner.protocol import Runner, RunnerFactory
from kvpark.sampling.params import SamplingParams

log = logging.getLogger("kvpark.engine.llm_engine")
IDLE_WAIT_S = 0.5
FAILED = "the engine failed: "  # the message of every error a failed engine gives


class EngineThread:
    """The thread and the state it shares with the asyncio side (``AsyncEngine`` extends it)."""

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
        self._streams = Streams()
        self.failure: str | None = None  # why the engine stopped serving; None while it serves
        self._ended: str | None = None  # AsyncEngine.end_streams's message, once it has run
        self._busy_since: float | None = None  # when the current turn of the loop began
        self._thread: threading.Thread | None = None
        self._slots: list[dict[str, object]] = []
        self._queued: dict[str, int] = {}  # request id -> place in the wait queue (published)
        self._announced: set[str] = set()  # waiting requests told so (engine thread only)
        self._adds = AddBatches(lambda batch: self._post("add", batch))  # one item per tick
        self._embeds: collections.deque[EmbedJob] = collections.deque()  # engine thread only
        # GET /v1/pool/events: the server's hub, once a viewer has come (engine/pool_view.py)
        self.pool_feed: PoolFeed | None = None
        self._pool_view = PoolView()  # engine thread only

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="kvpark-engine", daemon=True)
        self._thread.start()

    def health(self, timeout: float = 0.0) -> str | None:
        """Why the engine no longer serves (None while it does): it failed, its thread is gone,
        or (``timeout`` > 0) it has spent more than ``timeout`` s in one turn of its loop."""
        if self.failure is not None or not self.ready:
            return self.failure
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            return "the engine thread ended"
        since = self._busy_since
        if timeout > 0 and since is not None and time.monotonic() - since > timeout:
            return f"the engine thread made no progress for {timeout:g} s (--engine-timeout)"
        return None

    def fail(self, reason: str) -> None:
        """End the engine (any thread): every open stream's last event is a 500 naming
        ``reason``, and every later request is refused."""
        if self.failure is not None:
            return
        self.failure = reason
        log.critical("%s%s", FAILED, reason)
        self._streams.end_all(ErrorEvent(FAILED + reason, 500))
        waiting = list(self._embeds)  # the thread that would run them is gone or stuck
        while True:  # and what it has not read yet: the adds' streams have just ended
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "embed":
                waiting.append(payload)
        for job in waiting:
            job.settle(RuntimeError(FAILED + reason))

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    # ----------------------------------------------------------------- engine thread
    def _main(self) -> None:
        try:
            self._engine = LLMEngine(self.config, self._runner)
        except BaseException as e:
            log.exception("loading the model failed")
            self.load_error = f"{type(e).__name__}: {e}"
            return
        watch = StepWatch(self._engine, Knobs.from_env())
        self._slots = describe_slots(self._engine)
        self.ready = True
        try:
            self._serve(self._engine, watch)
        except BaseException as e:  # outside a step: nothing says what is left sound
            log.critical("the engine thread failed", exc_info=e)
            self.fail(f"the engine thread died: {type(e).__name__}: {e}")
            return
        if self.failure is not None:  # ended from outside (wedged, then back): leave it as it is
            return
        for job in self._embeds:  # shutdown: nobody is left to run them
            job.settle(RuntimeError("the engine stopped"))
        try:  # the pool as serving left it, checked once more (the soak reads this line)
            check_pool(self._engine, "serving (shutdown)")
        except BaseException as e:
            log.critical("%s", e)
        self._engine.close()  # shutdown: copies in flight land, then every cell and buffer is freed

    def _serve(self, engine: LLMEngine, watch: StepWatch) -> None:
        """The loop: inbox, one embedding prompt, one step; an idle wait when there is nothing."""
        while not self._stop.is_set() and self.failure is None:
            self._busy_since = time.monotonic()
            self._drain_inbox()
            self._embed_one()
            if engine.has_work:
                watch.begin()
                try:
                    events = engine.step()
                except BaseException as e:  # pyo3's PanicException is no Exception
                    events = fail_step(engine, watch, e)
                self._announce_queue(events)
                self._streams.dispatch(events)
                watch.after_step()
                self._slots = describe_slots(engine)
                self._pool_tick(engine)
            elif not self._embeds:
                self._slots = describe_slots(engine)
                due = self._pool_tick(engine)  # an abort just now changed the pool
                self._busy_since = None
                self._wake.wait(IDLE_WAIT_S if due is None else min(due, IDLE_WAIT_S))
                self._wake.clear()

    def _pool_tick(self, engine: LLMEngine) -> float | None:
        """A pool snapshot if one is due and someone watches; the seconds until the next may be
        (None: nobody watches). A bug here turns the pool view off, never the engine."""
        try:
            return self._pool_view.tick(engine, self.pool_feed)
        except Exception:
            log.exception("the pool view failed: GET /v1/pool/events gets no more snapshots")
            self.pool_feed = None
            return None

    def _drain_inbox(self) -> None:
        assert self._engine is not None
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                for request_id, prompt_ids, params in payload:
                    self._add(request_id, prompt_ids, params)
            elif kind == "abort":
                try:
                    self._engine.abort(payload)
                except BaseException:
                    log.exception("aborting %s failed", payload)
                    check_pool(self._engine, "a failed abort")
            elif kind == "embed":
                self._admit_embed(payload)

    def _admit_embed(self, job: EmbedJob) -> None:
        """An embedding job waits behind the ones before it (the first is running), and counts
        against ``--max-waiting`` with the generating requests waiting for a slot: past it, the
        same 503 as theirs."""
        assert self._engine is not None
        waiting = len(self._embeds)  # 0: it runs at once; else it waits, after waiting - 1 more
        if waiting and waiting + self._engine.waiting_beyond_slots() > self._max_waiting():
            job.settle(queue_full())
            return
        self._embeds.append(job)

    def _max_waiting(self) -> int:
        return self.config.scheduler.max_waiting

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        assert self._engine is not None
        # embedding jobs behind the running one wait too: they count against the same limit
        also_waiting = max(len(self._embeds) - 1, 0)
        try:
            self._engine.add_request(request_id, prompt_ids, params, also_waiting)
        except RequestRejected as e:  # the queue is full: refused before any event
            self._streams.dispatch({request_id: [ErrorEvent(e.message, e.code, e.kind)]})
        except BaseException:  # this request only: it never reached the scheduler's lists
            log.exception("adding %s failed", request_id)
            self._streams.dispatch({request_id: [ErrorEvent("internal error", 500)]})

    def _embed_one(self) -> None:
        """One prompt of the oldest embedding job (a turn of the loop: then a step runs)."""
        if not self._embeds:
            return
        assert self._engine is not None
        embed = embed_member(self._engine.runner)
        assert embed is not None  # check_embedding refused the job otherwise
        try:
            done = self._embeds[0].run_next(embed)
        except BaseException as e:
            log.exception("an embedding failed; its request gets a 500")
            self._embeds[0].settle(RuntimeError(f"the embedding failed: {type(e).__name__}"))
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
