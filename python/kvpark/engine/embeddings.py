"""Embedding jobs: ``AsyncEngine.embed`` posts one, the engine thread runs it between steps.

A runner that embeds has the optional member ``embed(token_ids) -> Tensor`` (float32
``[hidden]``; the built-in runners' is runner/embedding.py). The forward never touches the pool,
but it does use the model's weights and scratch, so it runs on the engine thread, the model's only
user, and never during a step. A job's prompts run one per turn of the engine loop, each turn
followed by a step of the requests in flight, so that a request of many long inputs delays the
streams beside it by one prompt's forward at a time, not by the whole request.

::

    route ── check_embedding(prompts) ── AsyncEngine.embed ── inbox "embed" ──► engine thread
      ▲                                                       turn: one prompt, then a step
      └───────────── future (call_soon_threadsafe) ◄── every prompt done / failed / cancelled
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from kvpark.engine.llm_engine import RequestRejected
from kvpark.runner.protocol import Runner, runner_name

# a runner's embed: token ids -> a float32 vector [hidden] (numpy or torch: anything with tolist)
Embed = Callable[[list[int]], Any]


def embed_member(runner: Runner) -> Embed | None:
    """The runner's optional ``embed`` method, or None when it has none."""
    embed = getattr(runner, "embed", None)
    return cast(Embed, embed) if callable(embed) else None


def check_embedding(
    runner: Runner, prompts: list[list[int]], vocab_size: int, max_model_len: int
) -> None:
    """:class:`RequestRejected` unless every prompt can be embedded: a 501 for a runner without
    ``embed``, a 400 naming ``input`` for an empty prompt, a token outside the vocabulary or a
    prompt longer than ``max_model_len``. Any thread may call it (it reads no engine state)."""
    if embed_member(runner) is None:
        raise RequestRejected(
            f"the runner {runner_name(runner)} has no embed method, so this server cannot "
            "compute embeddings (docs/custom-runners.md)",
            code=501,
            kind="not_implemented_error",
        )
    for i, ids in enumerate(prompts):
        where = f"input[{i}]" if len(prompts) > 1 else "input"
        if not ids:
            raise RequestRejected(f"{where} is empty", param="input")
        if any(t < 0 or t >= vocab_size for t in ids):
            raise RequestRejected(f"{where}: token ids must be in [0, {vocab_size})", param="input")
        if len(ids) > max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {max_model_len} tokens, however "
                f"{where} has {len(ids)} tokens. Please reduce the input.",
                param="input",
                kind="exceed_context_size_error",
            )


@dataclass
class EmbedJob:
    """One request's prompts, their vectors as they come, and the future that gets them."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[list[float]]]
    prompts: list[list[int]]
    vectors: list[list[float]] = field(default_factory=list)

    @property
    def abandoned(self) -> bool:
        """The awaiting side is gone (a disconnect cancelled it): skip the rest of its prompts.
        Read from the engine thread; a stale answer only costs one more forward."""
        return self.future.done()

    def run_next(self, embed: Embed) -> bool:
        """Embed the next prompt (engine thread); True once the job is over (settled)."""
        if self.abandoned:
            return True
        try:
            self.vectors.append(embed(self.prompts[len(self.vectors)]).tolist())
        except Exception as exc:
            self.settle(exc)
            raise
        if len(self.vectors) < len(self.prompts):
            return False
        self.settle(self.vectors)
        return True

    def settle(self, outcome: list[list[float]] | BaseException) -> None:
        """Hand the vectors (or the failure) to the future, on its own event loop."""
        with contextlib.suppress(RuntimeError):  # that event loop is closed
            self.loop.call_soon_threadsafe(_resolve, self.future, outcome)


def _resolve(
    future: asyncio.Future[list[list[float]]], outcome: list[list[float]] | BaseException
) -> None:
    if future.done():  # cancelled meanwhile
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
