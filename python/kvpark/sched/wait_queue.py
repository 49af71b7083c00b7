"""The wait queue and the admission rule: FIFO, a request takes ``n`` slots (one per choice), and
nobody passes a head that lacks them.

One rule, asked two ways: the scheduler admits the head while :meth:`WaitQueue.head_gets_slots`
(and its cells fit); the engine refuses a new request (503) when
:meth:`WaitQueue.queued_beyond_slots` says it would wait past ``--max-waiting``
(``Scheduler.wait_queue_full``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvpark.sched.request import Request


def gets_slots(wants: int, open_slots: int) -> bool:
    """Whether a request of ``wants`` choices at the head of the queue is given its slots."""
    return wants <= open_slots


class WaitQueue:
    """Requests not yet admitted, oldest first."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __contains__(self, request: object) -> bool:
        return request in self._queue

    def append(self, request: Request) -> None:
        self._queue.append(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    @property
    def head(self) -> Request:
        return self._queue[0]

    def pop_head(self) -> Request:
        return self._queue.popleft()

    def head_gets_slots(self, open_slots: int) -> bool:
        """Whether the head may be admitted now as far as slots go (its cells are the
        scheduler's question)."""
        return bool(self._queue) and gets_slots(self.head.params.n, open_slots)

    def queued_beyond_slots(self, open_slots: int, newcomer: int) -> int:
        """How many requests would wait once a newcomer of ``newcomer`` choices joins the queue.

        Only requests that no open slot will take count as queued ("beyond the slots"): admission
        hands the open slots to the head of the queue at the next step, so a burst at an idle
        server is let in up to ``parallel + max_waiting`` requests, however the engine thread
        happened to interleave it with steps.
        """
        queued = 0
        for wants in [*(req.params.n for req in self._queue), newcomer]:
            if queued == 0 and gets_slots(wants, open_slots):
                open_slots -= wants
            else:
                queued += 1  # nobody passes a head that lacks slots: the rest queue behind it
        return queued
