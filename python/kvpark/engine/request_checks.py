"""What refuses a request before it runs: ``RequestRejected`` (its HTTP status and OpenAI error
fields) and the checks of a prompt and its parameters against the model and the slots. Whether the
wait queue has room is the scheduler's question (``Scheduler.wait_queue_full``), asked when the
engine thread adds the request.
"""

from __future__ import annotations

import numpy as np

from kvpark.engine.choices import min_tokens_ban
from kvpark.sampling.grammar import GrammarCompiler
from kvpark.sampling.params import InvalidParameterError, SamplingParams


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


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    parallel: int,
    grammars: GrammarCompiler,
    eos_ids: frozenset[int],
) -> None:
    """Raise :class:`RequestRejected` for anything that would make this request fail later.

    Any thread may call it: it reads only the request, the model's limits and the grammar cache.
    """
    if not prompt_ids:
        raise RequestRejected("the prompt is empty", param="prompt")
    if any(
        not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab_size
        for t in prompt_ids
    ):
        raise RequestRejected(f"invalid tokens: ids must be in [0, {vocab_size})", param="prompt")
    try:
        params.validate(vocab_size)
        _check_constraint(params, grammars, vocab_size, eos_ids)
    except InvalidParameterError as e:
        raise RequestRejected(str(e), param=e.param) from None
    wanted = len(prompt_ids) + params.max_tokens
    if wanted > max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {wanted} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} "
            "for the completion). Please reduce the prompt or the completion length.",
            param="max_tokens",
            kind="exceed_context_size_error",
        )
    if params.n > parallel:
        raise RequestRejected(f"n must be at most {parallel} (--parallel)", param="n")


def _check_constraint(
    params: SamplingParams, grammars: GrammarCompiler, vocab_size: int, eos_ids: frozenset[int]
) -> None:
    """Compile the constraint (cached) and refuse one that allows no first token: the prompt's
    draw forks into the n choices, so the first token must exist for every choice."""
    c = params.constraint
    if c is None:
        return
    allowed = grammars.state(c).allowed(vocab_size)
    if not allowed.any():
        raise InvalidParameterError("the constraint allows no output at all", c.param)
    banned = min_tokens_ban(params, eos_ids) if params.min_tokens > 0 else ()
    if banned and not np.delete(allowed, banned).any():
        raise InvalidParameterError(
            "min_tokens cannot be met: the constraint allows only its end", "min_tokens"
        )
