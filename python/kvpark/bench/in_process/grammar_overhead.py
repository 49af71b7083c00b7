"""What a grammar costs inside the engine: the per-token mask against a decode step.

    kvpark bench --scenario grammar-overhead [--chats 1,8] [--tokens 48]

For each number of chats it runs that many JSON-schema-constrained requests (greedy, the same
schema, different prompts) on the default model, through prefill, and times every decode step: the
whole ``engine.step()`` and, inside it, the time spent in the grammar (each choice's mask,
``GrammarState.allowed``, and its commit, ``GrammarState.advance``). Prints one JSON line per
number of chats: median step ms, median grammar ms per step, and their ratio. The same requests
without a constraint give the unconstrained step time beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvpark import LLM, SamplingParams
from kvpark.sampling.grammar import GrammarState
from kvpark.sampling.params import Constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "hobbies", "city"],
    "additionalProperties": False,
}
PEOPLE = ["Ada", "Bob", "Chen", "Dana", "Eve", "Farid", "Gia", "Hugo"]


class GrammarClock:
    """Accumulates the seconds spent in GrammarState's mask and commit."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("allowed", "advance"):
            setattr(GrammarState, name, self._timed(getattr(GrammarState, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def decode_steps(
    llm: LLM, chats: int, tokens: int, constrained: bool, clock: GrammarClock
) -> tuple[list[float], list[float]]:
    """Per decode step (all chats past their prompt): wall seconds and grammar seconds."""
    engine = llm.engine
    c = Constraint("json_schema", json.dumps(SCHEMA)) if constrained else None
    for i in range(chats):
        prompt = f"Describe {PEOPLE[i % len(PEOPLE)]}, a person, as JSON with hobbies and a city."
        ids = engine.tokenizer.encode(prompt)
        p = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, constraint=c)
        engine.check_request(ids, p)
        engine.add_request(f"r{i}", ids, p)
    walls: list[float] = []
    grammar: list[float] = []
    while engine.has_work:
        decoding = all(s.pending_rows == 1 for r in engine.scheduler.running for s in r.sequences)
        full = len(engine.scheduler.running) == chats
        clock.seconds = 0.0
        start = time.perf_counter()
        engine.step()
        if decoding and full:
            walls.append(time.perf_counter() - start)
            grammar.append(clock.seconds)
    return walls, grammar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", default="1,8")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(parallel=8)
    clock = GrammarClock()
    decode_steps(llm, 1, 8, True, clock)  # warm up: the tokenizer view, the compiled grammar
    for chats in (int(x) for x in args.chats.split(",")):
        plain, _ = decode_steps(llm, chats, args.tokens, False, clock)
        walls, grammar = decode_steps(llm, chats, args.tokens, True, clock)
        step_ms = statistics.median(walls) * 1e3
        mask_ms = statistics.median(grammar) * 1e3
        row = {
            "chats": chats,
            "steps": len(walls),
            "plain_step_ms": round(statistics.median(plain) * 1e3, 2),
            "constrained_step_ms": round(step_ms, 2),
            "grammar_ms_per_step": round(mask_ms, 3),
            "grammar_us_per_token": round(mask_ms * 1e3 / chats, 1),
            "grammar_share_of_step": f"{100 * mask_ms / step_ms:.2f} %",
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
