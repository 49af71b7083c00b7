"""A stream whose client stopped reading: found by how long one write waits, then aborted.

uvicorn's ASGI ``send`` returns at once while the connection's write buffer is below its high-water
mark (64 KiB) and otherwise waits until the socket drains: a client that reads nothing fills the
kernel's buffers, then that one, and from then on every ``send`` waits. So "the client has not read
for S seconds" is "one ``send`` has waited S seconds" (``--stall-timeout``), whatever the socket
buffer sizes are. A slow reader that takes a frame now and then is never cut off by it.

What is not yet sent meanwhile waits in the request's ``FanIn`` (server/fanout.py), bounded by
``--stream-buffer`` events; past that the engine requests are aborted at once, so an endless
``max_tokens`` into a dead socket cannot hold cells or memory until the timeout.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Generator
from typing import Any

from starlette.types import Message, Send


class StalledClient(Exception):
    """One write waited longer than the stall timeout."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"the client read nothing for {timeout:g} s")
        self.timeout = timeout


async def send_within(send: Send, message: Message, timeout: float) -> None:
    """``send(message)``, or :class:`StalledClient` once it has waited ``timeout`` s (0: wait
    forever)."""
    if timeout <= 0:
        await send(message)
        return
    # The send runs here until it first waits. Below the high-water mark it never does (the
    # frame goes into the transport's buffer), and it is done without a task or a timer: a Task
    # and an asyncio.wait per frame had been about a seventh of the event loop's time at eight
    # streamed chats. Only a send that waits for the socket to drain goes on in a task, bounded.
    steps = send(message).__await__()
    try:
        pending = steps.send(None)
    except StopIteration:
        return
    # A task and asyncio.wait, not asyncio.wait_for: before Python 3.12 wait_for can swallow a
    # cancellation (the client's disconnect) that lands as the send completes.
    task = asyncio.ensure_future(_resumed(steps, pending))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except BaseException:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise StalledClient(timeout)
    task.result()  # the send's own error (the client went away: OSError)


@types.coroutine
def _resumed(steps: Generator[Any, None, Any], pending: Any) -> Generator[Any, None, Any]:
    """The rest of a started send: what it waits on (``pending``, then each next) is handed to
    the running task as its own wait, and what the task sends or throws back (its result, a
    cancellation) goes on into the send."""
    while True:
        try:
            sent = yield pending
        except BaseException as exc:  # a cancellation included: the send gets it
            try:
                pending = steps.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                pending = steps.send(sent)
            except StopIteration as stop:
                return stop.value
