"""The synchronous engine: one step = schedule → run → sample → update → events.

Only the thread that calls :meth:`LLMEngine.step` mutates the pool. ``AsyncEngine``
(async_engine.py) runs this loop on its own thread for the server; ``LLM`` (llm.py) drives it
directly.
"""

from __future__ import annotations

import hashlib
import random
import time

import numpy as np

from kvpark._core import PoolFullError
from kvpark.config.env import Knobs
from kvpark.config.layers import EngineConfig
from kvpark.engine.outputs import (
    Events,
    FinishedEvent,
    StreamEvent,
    TokenEvent,
    TokenLogprob,
)
from kvpark.engine.stats import EngineStats, Observations
from kvpark.preempt.buffers import Parking
from kvpark.preempt.copies import make_transfers
from kvpark.preempt.preemption import Preemption
from kvpark.runner.protocol import Runner, RunnerFactory, build_runner
from kvpark.sampling.grammar import DEAD_END, GrammarCompiler, GrammarState
from kvpark.sampling.params import InvalidParameterError, SamplingParams
from kvpark.sampling.sampler import NO_TOKEN, Generator, SampleRow, make_generator, sample_rows
from kvpark.sched.plan import StepPlan
from kvpark.sched.request import Request, Sequence
from kvpark.sched.scheduler import CONTEXT_ERROR, Scheduler
from kvpark.tokenizer.text_stream import TextStream


class RequestRejected(Exception):
    """A request refused before it runs; ``code`` is the HTTP status to answer with."""

    def __init__(
        self,
        message: str,
        code: int = 400,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind


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


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: Runner | RunnerFactory | None = None) -> None:
        """``runner``: a runner, or a factory called with ``config``; None: the one
        ``config.model.runner`` names, else the built-in (runner.protocol.build_runner)."""
        self.config = config
        self.runner: Runner = build_runner(config, runner)
        self.tokenizer = self.runner.tokenizer
        self.model_name = self.runner.model_name
        self.vocab_size = self.runner.vocab_size
        limit = config.scheduler.max_model_len or self.runner.max_model_len
        self.max_model_len = min(limit, config.pool.kv_cells)
        salt = prefix_cache_salt(config, self.model_name) if config.pool.prefix_cache else None
        self.scheduler = Scheduler(config.pool, config.scheduler, self.max_model_len, salt)
        self.stats = EngineStats(kv_cells_total=config.pool.kv_cells)
        self.observations = Observations()
        self._requests: dict[str, Request] = {}
        self._text: dict[tuple[str, int], TextStream] = {}
        self._generators: dict[tuple[str, int], Generator] = {}
        # per choice, beside its generator: where it stands in its grammar (structured output).
        # Advanced only in _emit, on tokens drawn and emitted: a recompute replay samples nothing
        # and a swap park touches no sampler state, so a park leaves the constrained output as is.
        self._grammar: dict[tuple[str, int], GrammarState] = {}
        self.grammars = GrammarCompiler(self.tokenizer)
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

    # ----------------------------------------------------------------- admission
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`RequestRejected` for anything that would make this request fail later.

        Any thread may call it: it reads only the request and the config. Whether the wait queue
        has room is :meth:`add_request`'s question.
        """
        if not prompt_ids:
            raise RequestRejected("the prompt is empty", param="prompt")
        if any(
            not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= self.vocab_size
            for t in prompt_ids
        ):
            raise RequestRejected(
                f"invalid tokens: ids must be in [0, {self.vocab_size})", param="prompt"
            )
        try:
            params.validate(self.vocab_size)
            self._check_constraint(params)
        except InvalidParameterError as e:
            raise RequestRejected(str(e), param=e.param) from None
        wanted = len(prompt_ids) + params.max_tokens
        if wanted > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {wanted} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} "
                "for the completion). Please reduce the prompt or the completion length.",
                param="max_tokens",
                kind="exceed_context_size_error",
            )
        if params.n > self.config.scheduler.parallel:
            raise RequestRejected(
                f"n must be at most {self.config.scheduler.parallel} (--parallel)", param="n"
            )

    def _check_constraint(self, params: SamplingParams) -> None:
        """Compile the constraint (cached) and refuse one that allows no first token: the prompt's
        draw forks into the n choices, so the first token must exist for every choice."""
        c = params.constraint
        if c is None:
            return
        allowed = self.grammars.state(c).allowed(self.vocab_size)
        if not allowed.any():
            raise InvalidParameterError("the constraint allows no output at all", c.param)
        banned = self._min_tokens_ban(params) if params.min_tokens > 0 else ()
        if banned and not np.delete(allowed, banned).any():
            raise InvalidParameterError(
                "min_tokens cannot be met: the constraint allows only its end", "min_tokens"
            )

    def _min_tokens_ban(self, params: SamplingParams) -> tuple[int, ...]:
        """What min_tokens masks: the tokens that would end the choice (EOS unless ignored)."""
        eos = () if params.ignore_eos else tuple(sorted(self.tokenizer.eos_ids))
        return tuple(sorted({*eos, *params.stop_token_ids}))

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> Request:
        """Queue a checked request; :class:`RequestRejected` (503) when the wait queue is full.

        The queue limit is checked here, by the thread that owns the engine, and not in
        :meth:`check_request`: another thread reading the queue's length could let a burst of
        requests past it.
        """
        if request_id in self._requests:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        if self._wait_queue_full(params.n):
            raise RequestRejected(
                "the server is busy: the wait queue is full", code=503, kind="unavailable_error"
            )
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        self._arrivals += 1
        req = Request(request_id, list(prompt_ids), params, seed, key=self._arrivals)
        self._requests[request_id] = req
        for j in range(params.n):
            self._generators[(request_id, j)] = make_generator(seed, j)
            if params.constraint is not None:  # every choice starts at the grammar's start
                self._grammar[(request_id, j)] = self.grammars.state(params.constraint)
            self._text[(request_id, j)] = TextStream(
                self.tokenizer, req.prompt_ids, params.stop, params.skip_special_tokens
            )
        self.scheduler.add(req)
        return req

    def _wait_queue_full(self, n: int) -> bool:
        """Whether a new request of ``n`` choices would queue past ``--max-waiting`` requests.

        Only requests that no free slot will take count as queued ("beyond the slots"): FIFO
        admission hands the free slots to the head of the queue at the next step, so a burst at an
        idle server is let in up to ``parallel + max_waiting`` requests, however the engine thread
        happened to interleave it with steps.
        """
        s = self.scheduler
        free = s.free_slot_count - s._slots_promised()
        queued = 0
        for wants in [*(req.params.n for req in s.waiting), n]:
            if queued == 0 and wants <= free:
                free -= wants
            else:
                queued += 1  # nobody passes a head that lacks slots: the rest queue behind it
        return queued > self.config.scheduler.max_waiting

    def abort(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._drop(req)
        self._refresh_gauges()
        return True

    def close(self) -> None:
        """Abort every request (shutdown): copies in flight land first, then everything is freed."""
        for request_id in list(self._requests):
            self.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

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
            rows.append(self._sample_row(req, seq, choices))
        draws = sample_rows(logits, rows) if rows else []
        for item in plan.items:
            _, seq = self.scheduler.by_seq[item.seq_id]
            seq.num_computed = item.start + len(item.token_ids)
        self.scheduler.register(plan)  # before a sequence that finishes below lets its cells go
        now = time.monotonic()
        for item, drawn in zip(sampled, draws, strict=True):
            req, seq = self.scheduler.by_seq[item.seq_id]
            if drawn[0][0] == NO_TOKEN:  # the masks left nothing: the choice ends here
                events.add(req.request_id, self._dead_end(req, seq))
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
                events.add(req.request_id, self._emit(req, s, token, logprob))
            if req.finished:
                events.add(req.request_id, self._finish(req, now))

    def _sample_row(self, req: Request, seq: Sequence, choices: range | list[int]) -> SampleRow:
        p = req.params
        allowed = None
        state = self._grammar.get((req.request_id, choices[0]))
        if state is not None:  # before a fork every choice is at the start: one mask serves all
            allowed = state.allowed(self.vocab_size)
        banned = self._min_tokens_ban(p) if seq.num_output < p.min_tokens else ()
        return SampleRow(
            p,
            [self._generators[(req.request_id, j)] for j in choices],
            seq.output_ids,
            req.prompt_ids,
            allowed,
            banned,
        )

    def _dead_end(self, req: Request, seq: Sequence) -> TokenEvent:
        """No token is allowed and the grammar is not complete (or min_tokens forbids its end)."""
        self.scheduler.finish_sequence(seq, DEAD_END)
        text = self._text[(req.request_id, seq.index)].finish()
        return TokenEvent(seq.index, text, [], None, DEAD_END)

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

    def _emit(
        self, req: Request, seq: Sequence, token: int, logprob: TokenLogprob | None
    ) -> TokenEvent:
        self.stats.generated_tokens_total += 1
        p = req.params
        text_stream = self._text[(req.request_id, seq.index)]
        reason: str | None = None
        grammar_end = self._advance_grammar(req, seq, token)
        if (token in self.tokenizer.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
            text = text_stream.finish()
        else:
            text, stopped = text_stream.push(token)
            if stopped:
                reason = "stop"
            elif grammar_end is not None:
                reason = grammar_end
                text += text_stream.finish()
            elif seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
                reason = "length"
                text += text_stream.finish()
        if reason is not None:
            self.scheduler.finish_sequence(seq, reason)
        return TokenEvent(
            seq.index, text, [token], [logprob] if logprob is not None else None, reason
        )

    def _advance_grammar(self, req: Request, seq: Sequence, token: int) -> str | None:
        """Commit an emitted token to the choice's grammar; the finish reason it implies: "stop"
        when the grammar is complete (once min_tokens are out: before that, its end is masked and
        the next draw finds a dead end), the dead end when it refused the token."""
        state = self._grammar.get((req.request_id, seq.index))
        if state is None:
            return None
        if not state.advance(token):
            return DEAD_END
        if state.complete and seq.num_output >= req.params.min_tokens:
            return "stop"
        return None

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
        for j in range(req.params.n):
            self._text.pop((req.request_id, j), None)
            self._generators.pop((req.request_id, j), None)
            self._grammar.pop((req.request_id, j), None)

    def _refresh_gauges(self) -> None:
        """Every gauge, in one place: after each step and each abort."""
        self.stats.requests_running = len(self.scheduler.running)
        self.stats.requests_waiting = len(self.scheduler.waiting)
        self.stats.kv_cells_used = self.scheduler.pool.cells_used()
        self.stats.kv_cells_cached = self.scheduler.pool.cells_cached()
        self.stats.prefix_cache_queries_total = self.scheduler.cache.queries
        self.stats.prefix_cache_hits_total = self.scheduler.cache.hits
        in_transfer = len(self.scheduler.transferring)  # parking or restoring: counted as parked
        self.stats.requests_preempted = len(self.scheduler.parked) + in_transfer
        if self.preemption is not None:
            self.stats.preempt_ram_bytes = self.preemption.parking.held_bytes
