"""Run a request's work only while its client is still connected.

Once a request's body is read, the next ASGI ``receive()`` returns only when the client goes away
(``http.disconnect``). Racing the work against it turns a vanished client into a cancellation of the
work, which closes the engine generators and so aborts the engine requests (vLLM's approach).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")

RECANCEL_S = 1.0


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(receive: Receive, work: Coroutine[object, object, T]) -> T | None:
    """The work's result, or None (the work cancelled and cleaned up) if the client left first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        await asyncio.gather(watch_task, return_exceptions=True)
        # Wait for the work's own cleanup (aborting the engine requests) to finish. Cancel again
        # while it runs on: code below us may swallow one cancellation (asyncio.wait_for before
        # Python 3.12 does), and an endless stream must not outlive its client.
        while not work_task.done():
            work_task.cancel()
            await asyncio.wait({work_task}, timeout=RECANCEL_S)
    if work_task.cancelled():
        return None
    return work_task.result()
