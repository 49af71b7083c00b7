"""Engine events -> OpenAI response objects and stream chunks, chat and completions alike.

A request of ``p`` prompts with ``n`` choices each has ``p * n`` choices; choice ``j`` of prompt
``i`` is ``index = i * n + j``. The final object (the whole response, or the stream's last chunk)
carries ``usage``, ``timings`` and, while preemption is on, ``preempt: {"parks", "recomputes"}``
merged over all prompts. In a stream the chunk that finishes the last choice is held back until
every prompt's :class:`FinishedEvent` is in, so it can carry them.

With a :class:`ToolPlan` each chat choice runs its text through its own ``ToolCallParser``: chunks
carry ``delta.tool_calls`` pieces (``tools_chunks.py``), the final object ``message.tool_calls``
(``content`` null when the choice wrote no text besides its calls), and a choice that made calls
and stopped finishes with ``tool_calls``. Logprobs stay those of every generated token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from kvpark.engine.outputs import FinishedEvent, TokenEvent, TokenLogprob
from kvpark.server.protocol import Kind, TokenizerLike
from kvpark.server.tools import ToolCallParser, ToolPlan
from kvpark.server.tools_chunks import chat_delta, finish_reason, message_tool_calls

JSON = dict[str, object]
MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # a chat stream sends the role with the first delta
    chars: int = 0  # length of the text so far: completions' logprobs.text_offset
    parser: ToolCallParser | None = None  # a chat request with tools: its text's calls


class Tally:
    """Billing and timing merged over the prompts of one request."""

    def __init__(self) -> None:
        self.finished: list[FinishedEvent] = []

    def usage(self) -> JSON:
        prompt = sum(f.prompt_tokens for f in self.finished)
        completion = sum(f.completion_tokens for f in self.finished)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # OpenAI's field: prompt tokens whose K and V came from the prefix cache
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in self.finished)},
        }

    def timings(self) -> JSON:
        # Prompts run side by side: counts add up, times are the longest. As llama.cpp's server:
        # prompt_n counts the prompt tokens computed, cache_n those the prefix cache supplied.
        cache_n = sum(f.cached_tokens for f in self.finished)
        prompt_n = sum(f.prompt_tokens for f in self.finished) - cache_n
        predicted_n = sum(f.completion_tokens for f in self.finished)
        prompt_ms = max((f.prompt_ms for f in self.finished), default=0.0)
        predicted_ms = max((f.predicted_ms for f in self.finished), default=0.0)
        return {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_second": _rate(prompt_n, prompt_ms),
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_second": _rate(predicted_n, predicted_ms),
        }

    def preempt(self) -> JSON:
        return {
            "parks": sum(f.parks for f in self.finished),
            "recomputes": sum(f.recomputes for f in self.finished),
        }


class ResponseBuilder:
    """Accumulates the choices of one request and renders chunks and the final object."""

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        n_prompts: int,
        n: int,
        tokenizer: TokenizerLike,
        logprobs: bool = False,
        include_usage: bool = False,
        with_preempt: bool = False,
        tools: ToolPlan | None = None,
    ) -> None:
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.n = n
        self.tokenizer = tokenizer
        self.want_logprobs = logprobs
        self.include_usage = include_usage
        self.with_preempt = with_preempt
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(n_prompts * n)]
        if tools is not None and kind == "chat":
            for choice in self.choices:
                choice.parser = tools.parser()
        self.tally = Tally()
        self._held: JSON | None = None
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    # -- events in ------------------------------------------------------------------------------

    def on_tokens(self, prompt: int, event: TokenEvent) -> list[JSON]:
        """Record the event; return its stream chunk, if it has one that is not held back."""
        index = prompt * self.n + event.index
        choice = self.choices[index]
        if choice.finish_reason is not None:
            return []  # nothing follows a choice's end
        offset = choice.chars
        choice.text.append(event.text)
        choice.chars += len(event.text)
        choice.logprobs.extend(event.logprobs or [])
        choice.finish_reason = event.finish_reason
        if not (event.text or event.logprobs or event.finish_reason or not choice.started):
            return []
        delta = None
        if choice.parser is not None:
            pieces = choice.parser.feed(event.text)
            if event.finish_reason is not None:
                pieces += choice.parser.finish()
                choice.finish_reason = finish_reason(event.finish_reason, choice.parser.calls)
            delta = chat_delta(pieces)
            if not (delta or event.logprobs or event.finish_reason or not choice.started):
                return []  # text held back while it may open a call
        chunk = self._chunk(
            index, choice, event.text, event.logprobs, offset, choice.finish_reason, delta
        )
        choice.started = True
        if event.finish_reason is not None and all(c.finish_reason for c in self.choices):
            self._held = chunk
            return []
        return [chunk]

    def on_finished(self, event: FinishedEvent) -> None:
        self.tally.finished.append(event)

    # -- objects out ----------------------------------------------------------------------------

    def closing_chunks(self) -> list[JSON]:
        """The stream's last chunks: the held final choice chunk (or one per unfinished choice) and
        the usage chunk; the very last one carries timings and the preempt record."""
        chunks = [] if self._held is None else [self._held]
        for index, choice in enumerate(self.choices):
            if choice.finish_reason is None:
                delta = None
                choice.finish_reason = "stop"
                if choice.parser is not None:
                    delta = chat_delta(choice.parser.finish())
                    choice.finish_reason = finish_reason("stop", choice.parser.calls)
                chunks.append(
                    self._chunk(index, choice, "", None, choice.chars, choice.finish_reason, delta)
                )
        if self.include_usage or not chunks:
            chunks.append({**self._envelope(), "choices": [], "usage": self.tally.usage()})
        chunks[-1].update(self._extras())
        return chunks

    def response(self) -> JSON:
        """The whole non-streamed response."""
        choices = [self._final_choice(i, c) for i, c in enumerate(self.choices)]
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            **self._envelope(obj),
            "choices": choices,
            "usage": self.tally.usage(),
            **self._extras(),
        }

    def _extras(self) -> JSON:
        extras: JSON = {"timings": self.tally.timings()}
        if self.with_preempt:
            extras["preempt"] = self.tally.preempt()
        return extras

    def _envelope(self, obj: str | None = None) -> JSON:
        if obj is None:
            obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(
        self,
        index: int,
        choice: ChoiceState,
        text: str,
        logprobs: list[TokenLogprob] | None,
        offset: int,
        finish_reason: str | None,
        parsed: JSON | None = None,
    ) -> JSON:
        """``parsed``: a tools choice's delta fields, in place of the raw ``text``."""
        rendered = self._logprobs(logprobs, offset) if logprobs else None
        if self.kind == "chat":
            delta: JSON = {"content": text} if text or not choice.started else {}
            if parsed is not None:
                delta = parsed  # no "content" yet: it stays null while only calls come
            if not choice.started:
                delta = {"role": "assistant", **delta}
            entry: JSON = {"index": index, "delta": delta, "logprobs": rendered}
        else:
            entry = {"index": index, "text": text, "logprobs": rendered}
        entry["finish_reason"] = finish_reason
        return {**self._envelope(), "choices": [entry]}

    def _final_choice(self, index: int, choice: ChoiceState) -> JSON:
        text = "".join(choice.text)
        rendered = self._logprobs(choice.logprobs, 0) if self.want_logprobs else None
        reason = choice.finish_reason or "stop"
        if choice.parser is not None and choice.finish_reason is None:
            choice.parser.finish()  # the engine ended it without a reason: flush what is held
            reason = finish_reason(reason, choice.parser.calls)
        if self.kind == "chat":
            message: JSON = {"role": "assistant", "content": text}
            if choice.parser is not None:
                calls = choice.parser.calls
                message["content"] = choice.parser.content or (None if calls else "")
                if calls:
                    message["tool_calls"] = message_tool_calls(calls)
            return {
                "index": index,
                "message": message,
                "logprobs": rendered,
                "finish_reason": reason,
            }
        return {"index": index, "text": text, "logprobs": rendered, "finish_reason": reason}

    # -- logprobs -------------------------------------------------------------------------------

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and bytes (a byte-level token may hold part of a UTF-8 character)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            try:
                raw = self.tokenizer.token_bytes(token_id)
            except ValueError:  # an id past the tokenizer (padded embedding rows)
                raw = b""
            piece = self._pieces[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return piece

    def _logprobs(self, entries: list[TokenLogprob], offset: int) -> JSON:
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens = [self._piece(e.token_id)[0] for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [{self._piece(t)[0]: _finite(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _chat_entry(self, entry: TokenLogprob) -> JSON:
        token, raw = self._piece(entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            alt, alt_raw = self._piece(token_id)
            top.append({"token": alt, "logprob": _finite(logprob), "bytes": alt_raw})
        return {
            "token": token,
            "logprob": _finite(entry.logprob),
            "bytes": raw,
            "top_logprobs": top,
        }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _rate(n: int, ms: float) -> float:
    return n * 1000.0 / ms if ms > 0 else 0.0
