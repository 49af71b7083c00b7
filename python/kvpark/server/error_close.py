"""An OpenAI stream that an engine error ends after it has started: every choice still open gets
its last chunk, with ``finish_reason: "error"``, before the in-stream error object and
``[DONE]``, so a client that reads choices sees each of them end.

Between the engine's events and the SSE writer (server/sse.py ``sse_frames``) sits
:class:`ErrorClose`, both its event source and its builder: on an ``ErrorEvent`` it first hands
the writer one empty ``TokenEvent`` with ``finish_reason="error"`` per open choice, and with the
last of them the builder's closing chunks (the final choice chunk it holds back, the usage chunk
with timings). An error before the first frame is left alone: it is still a plain JSON error with
its own status. The other APIs' streams end in their own error event (Responses ``error``,
Anthropic ``event: error``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvpark.engine.outputs import ErrorEvent, FinishedEvent, TokenEvent
from kvpark.server.fanout import End, PromptEvent, Timeout
from kvpark.server.responses import JSON
from kvpark.server.sse import EventSource, StreamBuilder

ERROR_FINISH = "error"


class ErrorClose:
    def __init__(
        self,
        events: EventSource,
        builder: StreamBuilder,
        choices: list[int],
        started: Callable[[], bool],
    ) -> None:
        """``choices``: each prompt's choice count; ``started``: whether a frame is out yet."""
        self._events = events
        self._builder = builder
        self._started = started
        self._open = {(p, i) for p, n in enumerate(choices) for i in range(n)}
        self._pending: deque[PromptEvent] = deque()
        self._last: TokenEvent | None = None  # the injected event that brings the closing chunks

    # -- the writer's event source --------------------------------------------------------------

    async def next(self, timeout: float | None) -> PromptEvent | Timeout | End:
        if self._pending:
            return self._pending.popleft()
        item = await self._events.next(timeout)
        if not isinstance(item, PromptEvent):
            return item
        event = item.event
        if isinstance(event, TokenEvent) and event.finish_reason is not None:
            self._open.discard((item.prompt, event.index))
        elif isinstance(event, ErrorEvent) and self._started() and self._open:
            for prompt, index in sorted(self._open):
                end = TokenEvent(index, "", [], None, ERROR_FINISH)
                self._pending.append(PromptEvent(prompt, end))
                self._last = end
            self._open.clear()
            self._pending.append(item)
            return self._pending.popleft()
        return item

    # -- the writer's builder -------------------------------------------------------------------

    def on_tokens(self, prompt: int, event: TokenEvent) -> list[JSON]:
        chunks = self._builder.on_tokens(prompt, event)
        if event is self._last:
            chunks += self._builder.closing_chunks()
        return chunks

    def on_finished(self, event: FinishedEvent) -> None:
        self._builder.on_finished(event)

    def closing_chunks(self) -> list[JSON]:
        return self._builder.closing_chunks()
