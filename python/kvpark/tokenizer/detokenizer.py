"""Streaming detokenization: one token in, the new text out, never half a character.

Decoding token by token is wrong twice over: a byte-level token can hold part of a UTF-8 character
(an emoji spans up to four tokens), and SentencePiece decoders strip the leading space of the first
token they see. So, as vLLM does, decode a short window that starts a few tokens back:

```
tokens:  ... | prefix_offset ......... read_offset | new tokens
               └ already emitted text ┘
delta = decode(tokens[prefix_offset:])  minus  decode(tokens[prefix_offset:read_offset])
```
and hold the delta back while it ends in U+FFFD (an incomplete character). The window keeps the cost
per token constant however long the output grows.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpark.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT = 5  # prompt tokens in the first window, so the first new token keeps its leading space


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        """prompt_ids (optional): the tokens before the first pushed one, for spacing context."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT:])
        if self._ids and self._ids[-1] in tokenizer.added_ids:
            # Text starts afresh after an added token (a chat's <|assistant|>): its first token
            # is decoded as a text's first, so a SentencePiece ▁ there is no space. Phi-3's
            # vocabulary puts that ▁ on every stretch of text between added tokens, and its
            # answer decoded alone (transformers, SentencePiece) has no leading space either.
            self._ids = []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """The text this token completes; "" while a character is still incomplete."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the end comes out as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        ids = self._ids
        prefix = self._tokenizer.decode(ids[self._prefix_offset : self._read_offset], self._skip)
        text = self._tokenizer.decode(ids[self._prefix_offset :], self._skip)
        if len(text) <= len(prefix) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        # The window moves on; drop what it no longer needs so the id list stays short.
        keep = self._read_offset
        self._ids = ids[keep:] if keep > 0 else ids
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return text[len(prefix) :]
