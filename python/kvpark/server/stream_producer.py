"""The task that runs a kept stream's frames into its log, whoever is connected.

A reattachable stream (server/reattach.py) and a background response (server/responses_kept.py)
outlive their connection, so their frames (server/relay.py ``stream_frames``, the frames a plain
stream writes) are pulled by this task instead of by the connection. Cancelling the task closes
the frames, which aborts the engine requests (server/fanout.py): every cell and parked byte comes
back. While it runs it counts as a request in flight, so a drain waits for it as for any other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable

from kvpark.server.errors import APIError
from kvpark.server.lifecycle import Lifecycle
from kvpark.server.stream_log import StreamLog

log = logging.getLogger("kvpark.server")


def start_producer(
    stream: StreamLog,
    frames: AsyncGenerator[bytes, None],
    lifecycle: Lifecycle,
    after_frame: Callable[[StreamLog], None] | None = None,
    name: str = "",
) -> asyncio.Task[None]:
    """The running task; ``after_frame(log)`` runs after each frame is logged (a bound check)."""
    return asyncio.create_task(_produce(stream, frames, lifecycle, after_frame, name))


async def _produce(
    stream: StreamLog,
    frames: AsyncGenerator[bytes, None],
    lifecycle: Lifecycle,
    after_frame: Callable[[StreamLog], None] | None,
    name: str,
) -> None:
    lifecycle.in_flight += 1
    try:
        async for frame in frames:
            stream.add(frame)
            if after_frame is not None:
                after_frame(stream)
    except APIError as refusal:  # before the first frame: a plain error for whoever reads it
        stream.fail(refusal)
    except Exception as exc:  # a bug below us: said in-stream, as SSEResponse says it
        log.error("stream %s failed", name, exc_info=exc)
        bug = APIError(500, f"internal error: {type(exc).__name__}")
        if not stream.started:
            stream.fail(bug)
        else:
            stream.add(stream.framing.error(bug) + stream.framing.done)
    finally:
        lifecycle.in_flight -= 1
        try:
            await frames.aclose()
        finally:
            stream.end()
