"""Structured output: a request's :class:`Constraint` compiled into a per-choice grammar state.

The library is llguidance (docs/structured-outputs.md says why): every constraint kind becomes an
llguidance grammar, checked against the served tokenizer when the request is checked (so a bad
schema or grammar is a 400 naming its field before anything streams), and each choice of the request
gets its own :class:`GrammarState`, a matcher that the engine advances only on tokens it emits.

One :class:`GrammarCompiler` per engine: it builds llguidance's view of the tokenizer once (lazily:
about a third of a second), and keeps a pristine matcher per (kind, source) that new requests copy,
so a schema that many requests share is compiled once. Any thread may call it (the server checks
requests off the engine thread); a lock guards the caches.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.gbnf_to_lark
import llguidance.numpy
import numpy as np
import numpy.typing as npt

from kvpark.sampling.params import Constraint, InvalidParameterError
from kvpark.tokenizer.tokenizer import Tokenizer

# finish reason of a choice whose grammar allows no next token and is not complete
DEAD_END = "grammar_dead_end"
CACHE_SIZE = 128  # pristine matchers kept, least recently used first out

# JSON without free whitespace: a small model given the choice fills its output with newlines
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_WHAT = {
    "json_schema": "JSON schema",
    "json_object": "JSON object",
    "gbnf": "GBNF grammar",
    "regex": "regular expression",
    "choice": "choice list",
    "lark": "Lark grammar",
}


class GrammarState:
    """One choice's place in its grammar; advanced by :meth:`advance` on each emitted token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size  # the tokenizer's: logits wider than it are masked past it
        # llguidance.numpy, not llguidance.torch: the latter runs torch.compile at import, which
        # loads dynamo and inductor (3-5 s and ~190 MiB in every process) for a kernel we skip
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def allowed(self, width: int) -> npt.NDArray[np.bool_]:
        """A bool mask ``[width]`` of the tokens the grammar allows next (EOS when complete)."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        return unpack_bitmask(self._bitmask[0], self._vocab, width)

    def advance(self, token: int) -> bool:
        """Commit an emitted token; False when the grammar refused it (the matcher is then dead)."""
        return bool(self._matcher.consume_token(token))

    @property
    def complete(self) -> bool:
        """Accepting and nothing more can follow: the choice is done."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


def unpack_bitmask(words: npt.NDArray[np.int32], vocab: int, width: int) -> npt.NDArray[np.bool_]:
    """llguidance's int32 words (bit i of word w: token 32w+i) as a bool mask of ``width``.

    numpy's unpackbits on the words' little-endian bytes gives the tokens in order, about ten
    times faster than shifting the words one by one (140 µs for 49152 tokens, most of a mask)."""
    raw = words.astype("<i4", copy=False).view(np.uint8)
    bits = np.unpackbits(raw, bitorder="little")[:vocab].view(np.bool_)
    if width > vocab:  # the model's vocabulary padded past the tokenizer's: never allowed
        return np.concatenate([bits, np.zeros(width - vocab, dtype=np.bool_)])
    return bits[:width]


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._pristine: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:  # callers hold the lock
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(),
                n_vocab=self._tokenizer.vocab_size,
                eos_token=sorted(self._tokenizer.eos_ids),
            )
        return self._ll_tokenizer

    def check(self, constraint: Constraint) -> None:
        """Raise :class:`InvalidParameterError` (naming ``constraint.param``) unless it compiles."""
        self._matcher(constraint)

    def state(self, constraint: Constraint) -> GrammarState:
        """A fresh state at the grammar's start (compiled once per (kind, source))."""
        return GrammarState(self._matcher(constraint), self._tokenizer.vocab_size)

    def _matcher(self, c: Constraint) -> llguidance.LLMatcher:
        key = (c.kind, c.source)
        with self._lock:
            pristine = self._pristine.get(key)
            if pristine is not None:
                self._pristine.move_to_end(key)
                return pristine.deep_copy()
            tokenizer = self._llg_tokenizer()
        grammar = grammar_text(c)  # outside the lock: compiling may take a while
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            raise InvalidParameterError(f"invalid {_WHAT[c.kind]}: {messages[0]}", c.param)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidParameterError(f"invalid {_WHAT[c.kind]}: {matcher.get_error()}", c.param)
        with self._lock:
            self._pristine[key] = matcher
            while len(self._pristine) > CACHE_SIZE:
                self._pristine.popitem(last=False)
            return matcher.deep_copy()


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar of a constraint; :class:`InvalidParameterError` for one that is
    malformed before it reaches the compiler (bad JSON, a GBNF that does not convert)."""
    what = _WHAT[c.kind]
    if c.kind == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS))
    if c.kind == "json_schema":
        schema = _json(c, what)
        if not isinstance(schema, dict | bool):
            raise InvalidParameterError(f"invalid {what}: not a JSON object", c.param)
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(c.source, _JSON_OPTIONS))
        except ValueError as e:
            raise InvalidParameterError(f"invalid {what}: {e}", c.param) from None
    if c.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(c.source))
    if c.kind == "choice":
        return str(llguidance.LLMatcher.grammar_from_lark(choice_lark(c)))
    if c.kind == "gbnf":
        try:
            lark = llguidance.gbnf_to_lark.gbnf_to_lark(c.source)
        except Exception as e:  # the converter raises GbnfToLarkError or a bare Exception
            raise InvalidParameterError(f"invalid {what}: {e}", c.param) from None
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    return str(llguidance.LLMatcher.grammar_from_lark(c.source))


def choice_lark(c: Constraint) -> str:
    """``choice``'s source is a JSON list of strings: a Lark rule with one literal each."""
    options = _json(c, "choice list")
    if (
        not isinstance(options, list)
        or not options
        or not all(isinstance(o, str) and o for o in options)
    ):
        raise InvalidParameterError("the choices must be a non-empty list of strings", c.param)
    # a JSON string literal is a Lark string literal (same quotes and escapes)
    return "start: " + " | ".join(json.dumps(o) for o in options)


def _json(c: Constraint, what: str) -> Any:
    try:
        return json.loads(c.source)
    except json.JSONDecodeError as e:
        raise InvalidParameterError(f"invalid {what}: not JSON ({e})", c.param) from None
