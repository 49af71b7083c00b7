"""Sampling parameters and their validation.

Every request carries its own seeded ``torch.Generator`` (built by the engine from ``seed``), so
nothing that happens to other requests — batching, parks, replays — can move its random stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_N = 16
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)


class InvalidParameterError(ValueError):
    """A sampling parameter is out of range or of the wrong type; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


ConstraintKind = Literal["json_schema", "json_object", "gbnf", "regex", "choice", "lark"]
CONSTRAINT_KINDS: frozenset[str] = frozenset(
    ("json_schema", "json_object", "gbnf", "regex", "choice", "lark")
)


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match; compiled to a grammar by ``kvpark.sampling.grammar``.

    ``source`` is the text of the constraint: a JSON schema (as JSON text), a GBNF or Lark grammar,
    a regular expression, or for ``choice`` a JSON list of strings; unused for ``json_object``.
    ``param`` is the request field it came from, so a bad one is a 400 that names it.
    """

    kind: ConstraintKind
    source: str = ""
    param: str = "response_format"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob plus the top k
    n: int = 1
    skip_special_tokens: bool = True
    logit_bias: tuple[
        tuple[int, float], ...
    ] = ()  # (token id, bias in [-100, 100]) added to logits
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (CTRL rule)
    constraint: Constraint | None = None  # structured output: a grammar the output must match
    # which cached pages it may share: only those of requests with the same salt (0: no salt;
    # the server folds the body's cache_salt and, by option, the API key into this u64)
    cache_salt: int = 0
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self, seed: int | None) -> SamplingParams:
        return replace(self, seed=seed)

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`InvalidParameterError` for anything a client could get wrong."""
        _check_int("max_tokens", self.max_tokens, 1, None)
        _check_float("temperature", self.temperature, 0.0, 2.0)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidParameterError("top_p must be in (0, 1]", "top_p")
        _check_int("top_k", self.top_k, -1, None)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**64 - 1)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParameterError(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameterError("stop strings must be non-empty strings", "stop")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, vocab_size - 1)
        if self.logprobs is not None:
            _check_int("top_logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        _check_int("n", self.n, 1, MAX_N)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameterError("ignore_eos must be a boolean", "ignore_eos")
        self._validate_new_fields(vocab_size)

    def _validate_new_fields(self, vocab_size: int) -> None:
        """logit_bias, min_tokens, repetition_penalty and the constraint's kind (the constraint's
        text is compiled, and so checked, by ``kvpark.sampling.grammar``)."""
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParameterError(
                f"at most {MAX_LOGIT_BIAS} logit_bias entries", "logit_bias"
            )
        for entry in self.logit_bias:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise InvalidParameterError("logit_bias maps token ids to biases", "logit_bias")
            _check_int("logit_bias", entry[0], 0, vocab_size - 1)
            _check_float("logit_bias", entry[1], -100.0, 100.0)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
                "min_tokens",
            )
        _check_int("cache_salt", self.cache_salt, 0, 2**64 - 1)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0)
        if self.repetition_penalty == 0.0:
            raise InvalidParameterError(
                "repetition_penalty must be in (0, 2]", "repetition_penalty"
            )
        c = self.constraint
        if c is not None and (not isinstance(c, Constraint) or c.kind not in CONSTRAINT_KINDS):
            param = c.param if isinstance(c, Constraint) else "response_format"
            raise InvalidParameterError(f"unknown constraint kind {c!r}", param)


def _check_int(name: str, value: object, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(f"{name} must be an integer", name)
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidParameterError(f"{name} must be {bound}, got {value}", name)


def _check_float(name: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidParameterError(f"{name} must be a number", name)
    if not math.isfinite(value) or value < lo or value > hi:
        raise InvalidParameterError(f"{name} must be in [{lo}, {hi}], got {value}", name)
