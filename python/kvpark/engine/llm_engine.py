"""The synchronous engine: one step = schedule → run → sample → update → events.

Only the thread that calls :meth:`LLMEngine.step` mutates the pool. ``AsyncEngine``
(async_engine.py) runs this loop on its own thread for the server; ``LLM`` (llm.py) drives it
directly.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time

from kvpark._core import PoolFullError
from kvpark.config.env import Knobs
from kvpark.config.layers import EngineConfig
from kvpark.engine.choices import Choices
from kvpark.engine.outputs import Events, FinishedEvent, StreamEvent
from kvpark.engine.pool_log import PoolLog
from kvpark.engine.request_checks import RequestRejected as RequestRejected
from kvpark.engine.request_checks import check_request
from kvpark.engine.stats import EngineStats, Observations
from kvpark.preempt.buffers import Parking
from kvpark.preempt.copies import make_transfers
from kvpark.preempt.preemption import Preemption
from kvpark.runner.protocol import Runner, RunnerFactory, build_runner
from kvpark.sampling.grammar import DEAD_END, GrammarCompiler
from kvpark.sampling.params import SamplingParams
from kvpark.sampling.sampler import NO_TOKEN, sample_rows
from kvpark.sched.plan import StepPlan
from kvpark.sched.request import Request
from kvpark.sched.scheduler import CONTEXT_ERROR, Scheduler
from kvpark.sched.window_space import window_space_cells

log = logging.getLogger("kvpark.engine")


def prefix_cache_salt(config: EngineConfig, model_name: str) -> int:
    """The pool's prefix-cache salt: what besides the tokens decides a cell's K and V here (one
    pool serves one model, so this guards against a page found under other arithmetic, never
    between requests). Stable across runs: a digest, not ``hash()``."""
    m = config.model
    ident = repr(
        (
            model_name,
            m.dtype,
            m.weights,
            m.prompt_path,
            m.kv_dtype,
            m.block_dot,
            m.exact,
            m.device,
            m.runner,
        )
    )
    return int.from_bytes(hashlib.blake2b(ident.encode(), digest_size=8).digest(), "little")


def queue_full() -> RequestRejected:
    """The 503 of a request past ``--max-waiting``, generating or embedding alike."""
    return RequestRejected(
        "the server is busy: the wait queue is full", code=503, kind="unavailable_error"
    )


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: Runner | RunnerFactory | None = None) -> None:
        """``runner``: a runner, or a factory called with ``config``; None: the one
        ``config.model.runner`` names, else the built-in (runner.protocol.build_runner)."""
        self.config = config
        self.runner: Runner = build_runner(config, runner)
        self.tokenizer = self.runner.tokenizer
        self.model_name = self.runner.model_name
        self.vocab_size = self.runner.vocab_size
        window = getattr(self.runner, "kv_window", None) if config.pool.window_release else None
        limit = config.scheduler.max_model_len or self.runner.max_model_len
        salt = prefix_cache_salt(config, self.model_name) if config.pool.prefix_cache else None
        space = self._window_space(config)
        self.scheduler = Scheduler(config.pool, config.scheduler, limit, salt, window, space)
        # behind a sliding window a sequence holds its window and a step, however long it grows
        fits = window is not None and self.scheduler.cells.window_cells(1) <= config.pool.kv_cells
        self.max_model_len = limit if fits else min(limit, config.pool.kv_cells)
        self.scheduler.max_model_len = self.max_model_len
        self.stats = EngineStats(
            kv_cells_total=config.pool.kv_cells, kv_window_cells_total=space[1] if space else 0
        )
        self.observations = Observations()
        self.pool_log = PoolLog()  # parks, resumes, rotations: the pool view's timeline
        self._requests: dict[str, Request] = {}
        self.grammars = GrammarCompiler(self.tokenizer)
        self.choices = Choices(self.tokenizer, self.grammars, self.vocab_size, self.max_model_len)
        self._seed_source = random.Random(config.seed)
        self._arrivals = 0
        self.preemption: Preemption | None = None
        if config.scheduler.preempt:
            knobs = Knobs.from_env()
            transfers = make_transfers(self.runner, config.scheduler.preempt_async)
            parking = Parking(
                self.runner, config.scheduler.parallel, knobs.preempt_fail_save, transfers
            )
            self.preemption = Preemption(
                config.scheduler, self.scheduler, parking, self.stats, self.observations, knobs
            )

    def _window_space(self, config: EngineConfig) -> tuple[int, int] | None:
        """(window, cells) of the sliding layers' own cell space, for a model mixing them with
        global layers whose runner can keep them apart (``kv_window_split``), where it saves
        cells (sched/window_space.py); the runner is told its size. None: they share the pool."""
        split = getattr(self.runner, "kv_window_split", None)
        if not (config.pool.window_release and split):
            return None
        s, p = config.scheduler, config.pool
        cells = window_space_cells(split, p.page_size, s.parallel, s.max_batch_tokens, p.kv_cells)
        if cells is None:
            return None
        self.runner.use_window_space(cells)  # type: ignore[attr-defined]
        log.info(
            "window space: the sliding layers (window %d) keep their K/V in %d cells of their"
            " own beside the pool's %d",
            split,
            cells,
            p.kv_cells,
        )
        return split, cells

    # ----------------------------------------------------------------- admission
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`RequestRejected` for anything that would make this request fail later
        (engine/request_checks.py). Any thread may call it; whether the wait queue has room is
        :meth:`add_request`'s question."""
        check_request(
            prompt_ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            parallel=self.config.scheduler.parallel,
            grammars=self.grammars,
            eos_ids=self.tokenizer.eos_ids,
        )

    def waiting_beyond_slots(self) -> int:
        """Requests waiting now that no open slot takes at the next step."""
        s = self.scheduler
        # a newcomer of no choices counts only when someone already waits: itself, not one more
        return max(s.waiting.queued_beyond_slots(s.open_slots, 0) - 1, 0)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        also_waiting: int = 0,
    ) -> Request:
        """Queue a checked request; :class:`RequestRejected` (503) when the wait queue is full.

        The queue limit is checked here, by the thread that owns the engine, and not in
        :meth:`check_request`: another thread reading the queue's length could let a burst of
        requests past it. ``also_waiting``: other work waiting for the engine that counts
        against the same limit (embedding jobs behind the running one: engine/engine_thread.py).
        """
        if request_id in self._requests:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        if self.scheduler.wait_queue_full(params.n):
            raise queue_full()
        if also_waiting > 0:  # only a newcomer that itself waits can be one too many
            s = self.scheduler
            queued = s.waiting.queued_beyond_slots(s.open_slots, params.n)
            waits = queued > self.waiting_beyond_slots()
            if waits and queued + also_waiting > s.config.max_waiting:
                raise queue_full()
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        self._arrivals += 1
        req = Request(request_id, list(prompt_ids), params, seed, key=self._arrivals)
        self._requests[request_id] = req
        self.choices.open(req)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._drop(req)
        self._refresh_gauges()
        return True

    def close(self) -> None:
        """Abort every request (shutdown): copies in flight land first, then everything is freed;
        then the runner's optional ``close()`` (a tensor-parallel runner stops its other ranks)."""
        for request_id in list(self._requests):
            self.abort(request_id)
        close = getattr(self.runner, "close", None)
        if callable(close):
            close()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def request_ids(self) -> list[str]:
        """Every request in the engine, from its add until it finishes, fails or is aborted."""
        return list(self._requests)

    # ----------------------------------------------------------------- one step
    def step(self) -> dict[str, list[StreamEvent]]:
        events = Events()
        if self.preemption is None:
            plan, outcome = self.scheduler.schedule()
        else:  # parks, resumes and relief rounds: preemption makes the step fit
            plan, outcome = self.preemption.fit_step(events, self._drop)
        for req in outcome.failed:
            self._drop(req)
            events.fail(req.request_id, CONTEXT_ERROR, "exceed_context_size_error")
        if not plan.empty:
            self._run(plan, events)
        self.pool_log.note_step(events.notices, self._requests, self.stats.rotations_total)
        self.stats.steps_total += 1
        self._refresh_gauges()
        return events.by_request

    def _run(self, plan: StepPlan, events: Events) -> None:
        logits = self.runner.execute(plan)
        sampled = [item for item in plan.items if item.sample]
        rows = []
        for item in sampled:
            req, seq = self.scheduler.by_seq[item.seq_id]
            choices = range(req.params.n) if len(req.sequences) < req.params.n else [seq.index]
            rows.append(self.choices.sample_row(req, seq, choices))
        draws = sample_rows(logits, rows) if rows else []
        for item in plan.items:
            _, seq = self.scheduler.by_seq[item.seq_id]
            seq.num_computed = item.start + len(item.token_ids)
        self.scheduler.register(plan)  # before a sequence that finishes below lets its cells go
        now = time.monotonic()
        for item, drawn in zip(sampled, draws, strict=True):
            req, seq = self.scheduler.by_seq[item.seq_id]
            if drawn[0][0] == NO_TOKEN:  # the masks left nothing: the choice ends here
                self.scheduler.finish_sequence(seq, DEAD_END)
                events.add(req.request_id, self.choices.dead_end(req, seq))
                if req.finished:
                    events.add(req.request_id, self._finish(req, now))
                continue
            if len(req.sequences) < req.params.n:
                try:
                    self.scheduler.fork(req, [t for t, _ in drawn])
                except PoolFullError:  # no page for the copy-on-write: the request cannot go on
                    self._drop(req)
                    events.fail(req.request_id, CONTEXT_ERROR, "exceed_context_size_error")
                    continue
                targets = list(zip(req.sequences, drawn, strict=True))
            else:
                seq.tokens.append(drawn[0][0])
                targets = [(seq, drawn[0])]
            self._on_first_or_next_token(req, now)
            for s, (token, logprob) in targets:
                self.stats.generated_tokens_total += 1
                event = self.choices.emit(req, s, token, logprob)
                if event.finish_reason is not None:
                    self.scheduler.finish_sequence(s, event.finish_reason)
                events.add(req.request_id, event)
            if req.finished:
                events.add(req.request_id, self._finish(req, now))

    def _on_first_or_next_token(self, req: Request, now: float) -> None:
        if req.park.replaying:  # the replay has caught up: the rotation clock starts now
            req.park.replaying = False
            req.park.resumed_at = now
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats.prompt_tokens_total += len(req.prompt_ids)
            self.observations.add("time_to_first_token_seconds", now - req.arrival)
        elif req.last_token_time is not None:
            self.observations.add("inter_token_latency_seconds", now - req.last_token_time)
        req.last_token_time = now

    def _finish(self, req: Request, now: float) -> FinishedEvent:
        self._drop(req)
        self.stats.requests_finished_total += 1
        first = req.first_token_time if req.first_token_time is not None else now
        per_choice = [s.num_output for s in sorted(req.sequences, key=lambda s: s.index)]
        event = FinishedEvent(
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=sum(per_choice),
            prompt_ms=(first - req.arrival) * 1000.0,
            predicted_ms=(now - first) * 1000.0,
            parks=req.parks,
            recomputes=req.recomputes,
            per_choice_tokens=per_choice,
            cached_tokens=req.cached_tokens,
        )
        return event

    def _drop(self, req: Request) -> None:
        """The request leaves: its cells, slot, park buffer and per-choice state go back."""
        if self.preemption is not None:  # a copy in flight lands before its cells are freed
            self.preemption.settle(req)
        self.scheduler.release(req)
        if self.preemption is not None:  # after the release, so the gauges see it gone
            self.preemption.forget(req)
        self._requests.pop(req.request_id, None)
        self.choices.close(req)

    def _refresh_gauges(self) -> None:
        """Every gauge, in one place: after each step and each abort."""
        self.stats.requests_running = len(self.scheduler.running)
        self.stats.requests_waiting = len(self.scheduler.waiting)
        self.stats.kv_cells_used = self.scheduler.pool.cells_used()
        self.stats.kv_cells_cached = self.scheduler.pool.cells_cached()
        if self.scheduler.cells.space is not None:
            self.stats.kv_window_cells_used = self.scheduler.cells.space.pool.cells_used()
        self.stats.prefix_cache_queries_total = self.scheduler.cache.queries
        self.stats.prefix_cache_hits_total = self.scheduler.cache.hits
        in_transfer = len(self.scheduler.transferring)  # parking or restoring: counted as parked
        self.stats.requests_preempted = len(self.scheduler.parked) + in_transfer
        if self.preemption is not None:
            self.stats.preempt_ram_bytes = self.preemption.parking.held_bytes
