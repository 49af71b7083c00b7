"""Every event of one kept stream, numbered, for whichever connection reads it now.

A kept stream (a reattachable one, ``--reattach-seconds``, or a background response) is not
written by its connection: a producer task (server/stream_producer.py) runs the stream's frames
into a :class:`StreamLog`, and each connection writes the log from its cursor on. Each event gets
its SSE ``id:``, 1, 2, 3, ... in order; on ``/v1/responses`` event ``k`` is the one with
``sequence_number`` ``k - 1``.

Comments that say something about the stream (park notices, ``: queued N``, ``: stream <id>``)
are logged like events, in order, but written as comment lines without the blank line that ends
an event: they ride with the event after them and carry its id. Why: once a stream has sent an
``id:``, a blank line ending a block of comments alone is, for the ``openai`` client's decoder, an
event with empty data that it then fails to parse as JSON; lines it skips are harmless. So a
replay after ``Last-Event-ID: k`` is the comments that came after event ``k`` and then the events.
Pings (``:`` and ``: preempt-keepalive``) say only that the connection is alive: they are handed
to the connection attached when they come (also without a blank line) and never logged.

Nothing here knows HTTP.
"""

from __future__ import annotations

import asyncio
import bisect

from kvpark.server.errors import APIError
from kvpark.server.sse import KEEPALIVE, PING, Framing

TRANSIENT = frozenset({PING, KEEPALIVE})


def blocks(frame: bytes) -> list[bytes]:
    """A frame's SSE blocks (events or comment blocks), without their blank lines. A frame may
    hold several (a Responses error is the ``error`` event and ``response.failed``); JSON data
    is one line, so a blank line only ever ends a block."""
    return [block for block in frame.split(b"\n\n") if block]


def is_comment(block: bytes) -> bool:
    return all(line.startswith(b":") for line in block.split(b"\n"))


class StreamLog:
    def __init__(self, stream_id: str | None, owner: bytes | None, framing: Framing) -> None:
        self.stream_id = stream_id  # None: not reattachable by id (a background response's log)
        self.owner = owner  # the digest of the API key that started it (None: no keys)
        self.framing = framing  # the API's: its error response before the first frame
        self.entries: list[bytes] = []  # comment lines and events, in order, as written
        # entry i belongs to event groups[i]: an event's own id, or the id of the event after it
        self.groups: list[int] = []
        self.event_at: list[bool] = []  # entry i is an event (not a comment)
        self.events = 0  # events logged: the last id given
        self.started = False  # a frame has come: status and headers may go out
        self.ended = False  # the producer is done: nothing comes after the last entry
        self.failure: APIError | None = None  # it failed before its first frame
        self.attached = False  # a connection is writing it now
        self.delivered = False  # a connection wrote its last entry: nobody needs it any more
        self.sent = 0  # entries the furthest connection has written
        self.bytes = 0  # what the entries hold
        self.ping = b""  # the latest ping, and how many have come
        self.pings = 0
        self._wake: asyncio.Future[None] | None = None
        if stream_id is not None:  # a client that reads only the body still learns the id
            self._log(f": stream {stream_id}\n".encode(), event=False)

    # -- the producer ---------------------------------------------------------------------------

    def add(self, frame: bytes) -> None:
        """The next frame the stream wrote: pings for the connection, the rest logged."""
        self.started = True
        for block in blocks(frame):
            if block + b"\n\n" in TRANSIENT:
                self.ping = block + b"\n"
                self.pings += 1
            elif is_comment(block):
                self._log(block + b"\n", event=False)
            else:
                self.events += 1
                self._log(block + f"\nid: {self.events}\n\n".encode(), event=True)
        self._notify()

    def fail(self, failure: APIError) -> None:
        """It failed before its first frame: a plain error answers whoever attaches."""
        self.failure = failure

    def end(self) -> None:
        self.ended = True
        self._notify()

    def _log(self, entry: bytes, event: bool) -> None:
        self.entries.append(entry)
        self.groups.append(self.events if event else self.events + 1)
        self.event_at.append(event)
        self.bytes += len(entry)

    @property
    def unread(self) -> int:
        """Events logged that no connection has written yet (comments are not counted)."""
        if self.sent == 0:
            return self.events
        last = self.sent - 1
        written = self.groups[last] if self.event_at[last] else self.groups[last] - 1
        return self.events - written

    # -- a connection ---------------------------------------------------------------------------

    def first_after(self, last_event_id: int) -> int:
        """The cursor (an entry index) just after event ``last_event_id`` (0: the start);
        ValueError past the last event logged."""
        if not 0 <= last_event_id <= self.events:
            raise ValueError(
                f"event {last_event_id} is not an event of this stream "
                f"(it has {self.events} so far)"
            )
        return bisect.bisect_right(self.groups, last_event_id)

    def wrote(self, cursor: int) -> None:
        self.sent = max(self.sent, cursor)

    async def changed(self) -> None:
        """Returns once an entry, a ping or the end has come (at once if already ended)."""
        if self.ended:
            return
        self._wake = self._wake or asyncio.get_running_loop().create_future()
        await asyncio.shield(self._wake)

    def _notify(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)
