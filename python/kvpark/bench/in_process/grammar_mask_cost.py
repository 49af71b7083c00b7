"""Per-token cost of a grammar mask, llguidance against xgrammar, on the default model's tokenizer.

Each matcher walks a fixed valid answer token by token: compute the next-token mask (a bitmask of
the 49152-token vocabulary), then commit the answer's token. Timed per token and reported as the
median over the walk, for 1 and 8 matchers stepping together (8 chats: the 8 masks of one decode
step, computed one after another on this thread, as the sampler does). Compile time (grammar
construction) is reported apart: it is paid once per request, before the first token.

    kvpark bench --scenario grammar-mask-cost [--repeat 3]

xgrammar is in the ``bench`` extra only; kvpark itself uses llguidance (docs/structured-outputs.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.torch
import torch
import xgrammar
from transformers import PreTrainedTokenizerFast

from kvpark.model.loader import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "active"],
    "additionalProperties": False,
}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "languages": ["English", "French"], "active": true}'


class Walker:
    """One library's matchers: ``mask(i)`` fills row i of the bitmask, ``commit(i, t)`` eats t."""

    mask: Callable[[int], object]  # what each library returns is not read
    commit: Callable[[int, int], bool]


def llg_walkers(tok: Any, grammar: str, n: int, vocab: int) -> tuple[Walker, float]:
    start = time.perf_counter()
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(n)]
    compile_s = (time.perf_counter() - start) / n
    assert not matchers[0].is_error(), matchers[0].get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(n, vocab)
    w = Walker()
    w.mask = lambda i: llguidance.torch.fill_next_token_bitmask(matchers[i], bitmask, i)
    w.commit = lambda i, t: matchers[i].consume_token(t)
    return w, compile_s


def xgr_walkers(compile_: Callable[[], Any], n: int, vocab: int) -> tuple[Walker, float]:
    start = time.perf_counter()
    compiled = compile_()
    compile_s = time.perf_counter() - start
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(n)]
    bitmask = xgrammar.allocate_token_bitmask(n, vocab)
    w = Walker()
    w.mask = lambda i: matchers[i].fill_next_token_bitmask(bitmask, i)
    w.commit = lambda i, t: matchers[i].accept_token(t)
    return w, compile_s


def walk(w: Walker, n: int, ids: list[int]) -> tuple[float, float]:
    """Median and worst microseconds per step (all n masks + commits of one step)."""
    per_step = []
    for t in ids:
        start = time.perf_counter()
        for i in range(n):
            w.mask(i)
            if not w.commit(i, t):
                raise RuntimeError(f"the answer's token {t} was refused")
        per_step.append(time.perf_counter() - start)
    return statistics.median(per_step) * 1e6, max(per_step) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="walks per case; the best is kept")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer()
    vocab = tok.vocab_size
    eos = sorted(tok.eos_ids)
    llg_tok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=eos)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend)  # type: ignore[no-untyped-call]
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    xgr_setup = time.perf_counter() - start
    ids = tok.encode(ANSWER, add_special_tokens=False)
    schema_text = json.dumps(SCHEMA)
    cases: dict[str, tuple[str, Callable[[], Any]]] = {
        "json_schema": (
            llguidance.LLMatcher.grammar_from_json_schema(schema_text),
            lambda: compiler.compile_json_schema(schema_text),
        ),
        "json_object": (
            llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}'),
            compiler.compile_builtin_json_grammar,
        ),
    }
    results: list[dict[str, object]] = []
    for name, (llg_grammar, xgr_compile) in cases.items():
        for n in (1, 8):
            for lib in ("llguidance", "xgrammar"):
                best, worst = float("inf"), float("inf")
                compile_s = 0.0
                for _ in range(args.repeat):
                    if lib == "llguidance":
                        w, compile_s = llg_walkers(llg_tok, llg_grammar, n, vocab)
                    else:
                        w, compile_s = xgr_walkers(xgr_compile, n, vocab)
                    median, top = walk(w, n, ids)
                    best, worst = min(best, median), min(worst, top)
                row: dict[str, object] = {
                    "grammar": name,
                    "chats": n,
                    "library": lib,
                    "us_per_step": round(best, 1),
                    "us_per_token": round(best / n, 1),
                    "worst_us_per_step": round(worst, 1),
                    "compile_ms": round(compile_s * 1e3, 2),
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    print(
        json.dumps({"xgrammar_tokenizer_setup_ms": round(xgr_setup * 1e3, 1), "tokens": len(ids)})
    )


if __name__ == "__main__":
    main()
