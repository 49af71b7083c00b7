"""``echo`` on ``/v1/completions``: each choice's text starts with its prompt's text.

The prompt text goes through the response builder as a first token event of its own, so the
non-streamed text is prompt + completion and a stream's first chunk of each choice is the prompt.
Echo with ``logprobs`` is refused at parsing (the engine computes no prompt logprobs), so the
offsets the builder counts never need the prompt's tokens.
"""

from __future__ import annotations

from kvpark.engine.outputs import FinishedEvent, TokenEvent
from kvpark.server.responses import JSON, ResponseBuilder


class EchoBuilder:
    """A :class:`ResponseBuilder` whose choices begin with their prompt's text."""

    def __init__(self, inner: ResponseBuilder, texts: list[str]) -> None:
        self.inner = inner
        self.texts = texts
        self._echoed: set[tuple[int, int]] = set()  # (prompt, choice) pairs already echoed

    def on_tokens(self, prompt: int, event: TokenEvent) -> list[JSON]:
        chunks = []
        if (prompt, event.index) not in self._echoed:
            self._echoed.add((prompt, event.index))
            text = self.texts[prompt]
            if text:
                chunks += self.inner.on_tokens(prompt, TokenEvent(event.index, text, [], None))
        return chunks + self.inner.on_tokens(prompt, event)

    def on_finished(self, event: FinishedEvent) -> None:
        self.inner.on_finished(event)

    def closing_chunks(self) -> list[JSON]:
        return self.inner.closing_chunks()

    def response(self) -> JSON:
        return self.inner.response()
