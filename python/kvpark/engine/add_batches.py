"""The adds of one event-loop tick, held back and posted to the engine thread as one inbox item.

The prompts of one HTTP request start in the same tick: posted together, they are admitted
together, so a full queue refuses the whole request before any prompt streams.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from kvpark.sampling.params import SamplingParams

Add = tuple[str, list[int], SamplingParams]  # request id, prompt ids, params


class AddBatches:
    def __init__(self, post: Callable[[list[Add]], None]) -> None:
        """``post``: hands one tick's adds to the engine thread."""
        self._post = post
        self._held: dict[asyncio.AbstractEventLoop, list[Add]] = {}  # this tick's adds, per loop
        self._lock = threading.Lock()

    def hold(self, loop: asyncio.AbstractEventLoop, add: Add) -> None:
        """Hold the add back until the end of this tick of ``loop``, then post the tick's adds."""
        with self._lock:
            held = self._held.setdefault(loop, [])
            held.append(add)
            first = len(held) == 1
        if first:
            loop.call_soon(self.flush, loop)

    def flush(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Post the held adds of ``loop`` (None: of every loop)."""
        with self._lock:
            if loop is None:
                batches = list(self._held.values())
                self._held.clear()
            else:
                batches = [self._held.pop(loop, [])]
        for batch in batches:
            if batch:
                self._post(batch)
