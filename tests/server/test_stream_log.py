"""A kept stream's log and its bound, in process (server/stream_log.py, server/reattach.py).

The log numbers events and lets comments ride with the event after them; pings are never logged;
a cursor after any event id replays exactly what came after it. The registry bounds a stream's
unwritten events (``--stream-buffer``): one more gives the stream up once, with the in-stream
error, and its producer no longer counts as a request in flight.
"""

from __future__ import annotations

import asyncio

import pytest

from kvpark.server.lifecycle import Lifecycle
from kvpark.server.reattach import Reattach
from kvpark.server.sse import KEEPALIVE, OPENAI, PING
from kvpark.server.stream_log import StreamLog


def test_events_are_numbered_and_comments_ride_with_the_next_one() -> None:
    log = StreamLog("strm_x", None, OPENAI)
    log.add(b": queued 1\n\n")
    log.add(b'data: {"a":1}\n\n')
    log.add(PING)
    log.add(b": preempted\n\n")
    log.add(KEEPALIVE)
    log.add(b": resumed\n\n")
    log.add(b'event: error\ndata: {"b":2}\n\nevent: response.failed\ndata: {"c":3}\n\n')
    body = b"".join(log.entries)
    assert body == (
        b": stream strm_x\n: queued 1\n"
        b'data: {"a":1}\nid: 1\n\n'
        b": preempted\n: resumed\n"
        b'event: error\ndata: {"b":2}\nid: 2\n\n'
        b'event: response.failed\ndata: {"c":3}\nid: 3\n\n'
    )
    assert log.events == 3 and log.pings == 2 and log.ping == b": preempt-keepalive\n"
    # a blank line only ever ends an event: no block of comments alone
    assert all(b"id: " in block for block in body.split(b"\n\n") if block)
    assert b"".join(log.entries[log.first_after(0) :]) == body
    assert b"".join(log.entries[log.first_after(1) :]).startswith(b": preempted\n")
    assert log.entries[log.first_after(2) :] == [log.entries[-1]]
    assert log.entries[log.first_after(3) :] == []
    with pytest.raises(ValueError, match="it has 3 so far"):
        log.first_after(4)
    assert log.unread == 3
    log.wrote(log.first_after(1))
    assert log.unread == 2  # comments are not counted


def test_a_stream_past_its_buffer_is_given_up_once() -> None:
    async def scenario() -> None:
        lifecycle = Lifecycle()
        gave_up: list[str] = []

        async def frames() -> object:
            n = 0
            while not gave_up:
                n += 1
                yield f'data: {{"n":{n}}}\n\n'.encode()
                await asyncio.sleep(0)
            yield b'data: {"error":{"code":503}}\n\ndata: [DONE]\n\n'

        registry = Reattach(60.0, 8, lifecycle)
        stream = registry.start(frames(), OPENAI, None, gave_up.append)  # type: ignore[arg-type]
        registry.detach(stream, delivered=False)  # nobody reads it
        while not stream.ended:
            await stream.changed()
        assert gave_up == ["stream buffer full: the client did not read 8 events"]
        assert stream.events == 9 + 2  # the ninth unwritten event gave it up; the error, [DONE]
        assert stream.entries[-1] == b"data: [DONE]\nid: 11\n\n"
        assert lifecycle.in_flight == 0
        assert registry.detached() == 1 and registry.held_bytes() == stream.bytes > 0
        # still there to be read, after any event
        assert registry.attach(stream.stream_id or "", None) is stream
        await registry.close()
        assert len(registry) == 0

    asyncio.run(scenario())
