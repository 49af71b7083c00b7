"""``send_within`` (server/stall.py) on its own, against ASGI sends that stand in for uvicorn's: a
frame that goes straight into the buffer takes no task and no timer; a send that waits for the
socket goes on in one task, bounded by the stall timeout, and gets back what that task gets (the
drained socket, an error, a cancellation)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

import pytest
from starlette.types import Message

from kvpark.server.stall import StalledClient, send_within


def run_counting_tasks(scenario: Callable[[], Coroutine[Any, Any, None]]) -> int:
    """Runs ``scenario`` and returns how many tasks were created while it ran."""
    created: list[object] = []
    counted: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def factory(
            loop: asyncio.AbstractEventLoop,
            coro: Generator[Any, None, Any] | Coroutine[Any, Any, Any],
            **kwargs: Any,
        ) -> asyncio.Task[Any]:
            task = asyncio.Task(coro, loop=loop, **kwargs)
            created.append(task)
            return task

        loop.set_task_factory(factory)
        await scenario()
        counted.append(len(created))

    asyncio.run(main())
    return counted[0]


def test_a_frame_into_the_buffer_takes_no_task() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:  # below the high-water mark: no wait
        sent.append(message)

    async def scenario() -> None:
        for i in range(3):
            await send_within(send, {"body": bytes([i])}, timeout=5.0)

    assert run_counting_tasks(scenario) == 0
    assert sent == [{"body": b"\x00"}, {"body": b"\x01"}, {"body": b"\x02"}]


def test_a_send_that_waits_for_the_socket_finishes_in_one_task() -> None:
    steps: list[str] = []

    def waiting_send(drained: asyncio.Future[str]) -> Callable[[Message], Awaitable[None]]:
        async def send(message: Message) -> None:
            steps.append("buffered")
            steps.append(await drained)  # the socket drains: uvicorn's flow control resumes
            steps.append("written")

        return send

    async def scenario() -> None:
        drained: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, drained.set_result, "drained")
        await send_within(waiting_send(drained), {"body": b"x"}, timeout=5.0)

    assert run_counting_tasks(scenario) == 1
    assert steps == ["buffered", "drained", "written"]


def test_a_send_that_never_drains_is_a_stalled_client_and_is_cancelled() -> None:
    ended: list[str] = []

    async def send(message: Message) -> None:
        try:
            await asyncio.get_running_loop().create_future()  # the reader never reads
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    async def scenario() -> None:
        with pytest.raises(StalledClient) as stalled:
            await send_within(send, {"body": b"x"}, timeout=0.05)
        assert stalled.value.timeout == 0.05
        await asyncio.sleep(0)  # the cancelled task runs its cleanup

    asyncio.run(scenario())
    assert ended == ["cancelled"]


def test_the_send_s_own_error_after_a_wait_reaches_the_caller() -> None:
    async def send(message: Message) -> None:
        await asyncio.sleep(0.01)
        raise ConnectionResetError("the client went away")

    async def scenario() -> None:
        with pytest.raises(ConnectionResetError):
            await send_within(send, {"body": b"x"}, timeout=5.0)

    asyncio.run(scenario())


def test_a_cancelled_caller_cancels_the_waiting_send() -> None:
    ended: list[str] = []

    async def send(message: Message) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    async def scenario() -> None:
        caller = asyncio.ensure_future(send_within(send, {"body": b"x"}, timeout=5.0))
        await asyncio.sleep(0.01)
        caller.cancel()  # the client disconnected while the write waited
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert ended == ["cancelled"]


def test_without_a_timeout_the_send_is_awaited_as_it_is() -> None:
    async def send(message: Message) -> None:
        await asyncio.sleep(0.01)

    async def scenario() -> None:
        await send_within(send, {"body": b"x"}, timeout=0.0)

    assert run_counting_tasks(scenario) == 0
