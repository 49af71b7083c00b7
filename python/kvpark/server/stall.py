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
    # A task and asyncio.wait, not asyncio.wait_for: before Python 3.12 wait_for can swallow a
    # cancellation (the client's disconnect) that lands as the send completes.
    task = asyncio.ensure_future(send(message))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except BaseException:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise StalledClient(timeout)
    task.result()  # the send's own error (the client went away: OSError)
