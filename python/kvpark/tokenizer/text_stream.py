"""A choice's text as it streams: incremental detokenisation plus stop strings.

Text that could still become a stop string is held back until it cannot; when a stop string appears,
the text before it is released and the choice ends. A stop string is never part of the output.
"""

from __future__ import annotations

from kvpark.tokenizer.detokenizer import IncrementalDetokenizer
from kvpark.tokenizer.tokenizer import Tokenizer


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: tuple[str, ...],
        skip_special_tokens: bool,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stop = stop
        self._text = ""
        self._emitted = 0

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (text to emit now, whether a stop string ended the choice)."""
        self._text += self._detok.push(token_id)
        if not self._stop:
            return self._take(len(self._text)), False
        search_from = max(0, self._emitted - max(len(s) for s in self._stop))
        hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            end = min(hits)
            self._text = self._text[:end]
            return self._take(end), True
        return self._take(len(self._text) - self._held_back()), False

    def finish(self) -> str:
        """The rest of the text once the choice ends for another reason (length, eos)."""
        self._text += self._detok.flush()
        return self._take(len(self._text))

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        tail = self._text[self._emitted :]
        for n in range(min(len(tail), max(len(s) for s in self._stop) - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self._stop):
                return n
        return 0

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        return out
