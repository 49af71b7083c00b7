"""The unparked reference the forced-park scenarios compare with
(tests/server/test_preempt_forced.py and test_preempt_recompute.py): a server with preemption off
on float32 cells, the completion it gives, and the logprobs a parked stream gave, to set beside
it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from support.preempt_server import POOL, Stream, flags, post
from support.servers import Server, serve_for_module

PROMPT = "Once upon a time, in a small village at the edge of the forest,"


# float32 cells on the forced-park servers: a recompute replay takes the prompt path, and in normal
# mode its logprobs are compared within float32 rounding; a bf16 pool rounds each path's K and V
# (the default pool's parks are covered by test_preempt_pressure.py and the engine tests)
F32_CELLS = ("--kv-dtype", "float32")


def serve_reference() -> Iterator[Server]:
    """Body of a module's ``reference`` fixture: preemption off, 512 cells, 2 slots, 128-token
    steps."""
    yield from serve_for_module(*flags(POOL, 2, 128, "--no-preempt"), *F32_CELLS)


def reference_completion(reference: Server, body: dict[str, Any], path: str) -> dict[str, Any]:
    response = post(reference, path, body)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    assert "preempt" not in out  # preemption off: upstream's shape
    return out


def streamed_completion_logprobs(s: Stream) -> list[tuple[str, float]]:
    pairs = []
    for chunk in s.data:
        for choice in chunk.get("choices", []):
            lp = choice.get("logprobs")
            if lp:
                pairs += list(zip(lp["tokens"], lp["token_logprobs"], strict=True))
    return pairs


def streamed_chat_logprobs(s: Stream) -> list[tuple[str, float]]:
    pairs = []
    for chunk in s.data:
        for choice in chunk.get("choices", []):
            lp = choice.get("logprobs")
            if lp:
                pairs += [(e["token"], e["logprob"]) for e in lp["content"]]
    return pairs
