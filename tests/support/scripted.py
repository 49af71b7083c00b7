"""Stand-ins for the engine side of an SSE stream: events on a script (park notices and long
silences on cue) and a response builder over a fake tokenizer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from kvpark.engine.outputs import FinishedEvent, StreamEvent, TokenEvent
from kvpark.server.fanout import End, PromptEvent, Timeout
from kvpark.server.responses import ResponseBuilder

FINISHED = FinishedEvent(prompt_tokens=3, completion_tokens=1, prompt_ms=1.0, predicted_ms=2.0)


class FakeTokenizer:
    vocab_size = 100

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 100 for c in text]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(65 + i % 26) for i in ids)

    def token_to_str(self, token_id: int) -> str:
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode()

    def apply_chat_template(
        self, messages: Any, add_generation_prompt: bool = True, tools: Any = None
    ) -> str:
        return ""


class ScriptedSource:
    """Events at fixed times (seconds after the first ``next``), honouring the reader's timeout."""

    def __init__(self, script: list[tuple[float, int, StreamEvent]]) -> None:
        self.script = list(script)
        self.start: float | None = None

    async def next(self, timeout: float | None) -> PromptEvent | Timeout | End:
        now = time.monotonic()
        if self.start is None:
            self.start = now
        if not self.script:
            return "end"
        at, prompt, event = self.script[0]
        wait = self.start + at - now
        if timeout is not None and timeout < wait:
            await asyncio.sleep(timeout)
            return "timeout"
        await asyncio.sleep(max(wait, 0.0))
        self.script.pop(0)
        return PromptEvent(prompt, event)


def token(text: str, finish: str | None = None, index: int = 0) -> TokenEvent:
    return TokenEvent(index, text, [1], None, finish)


def builder(n_prompts: int = 1, **options: bool) -> ResponseBuilder:
    return ResponseBuilder("completion", "cmpl-1", "m", n_prompts, 1, FakeTokenizer(), **options)
