"""What the engine streams back for a request: token events, park notices and a final record.

These are plain data; the server turns them into OpenAI chunks and SSE comments. A request with
``n`` choices emits events whose ``index`` is the choice (0..n-1).

``QueuedEvent`` comes only from ``AsyncEngine`` (the offline ``LLM`` never waits on a client), and
only as a request's first event; anyone who does not care about waiting may ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpark.sampling.logprob import TokenLogprob as TokenLogprob


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one choice since the last event (usually one token)."""

    index: int
    text: str  # detokenised delta: never half a UTF-8 character; stop strings already cut
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the choice's last event


@dataclass(frozen=True)
class NoticeEvent:
    """A park or resume of the request: ``kind`` is preempted, resumed or recomputed."""

    kind: str
    index: int = 0


@dataclass(frozen=True)
class QueuedEvent:
    """The request waits in the engine's queue for a slot or for room.

    ``position`` is its 1-based place in the wait queue when it was first found waiting; the
    current place is ``AsyncEngine.queue_position(request_id)`` until it leaves the queue.
    """

    position: int


@dataclass(frozen=True)
class FinishedEvent:
    """Last event of a request: billing and timing for all of its choices."""

    prompt_tokens: int  # the prompt the client sent, whatever was replayed
    completion_tokens: int  # summed over choices
    prompt_ms: float
    predicted_ms: float
    parks: int = 0
    recomputes: int = 0
    per_choice_tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (not computed)


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed after it was accepted (the context error, say); ``code``: HTTP status."""

    message: str
    code: int = 500
    kind: str = "server_error"


StreamEvent = TokenEvent | NoticeEvent | QueuedEvent | FinishedEvent | ErrorEvent


@dataclass
class Events:
    """One step's events, by request id, in the order they happened (a park's notices before the
    step's tokens). The engine collects them; preemption adds its notices through it."""

    by_request: dict[str, list[StreamEvent]] = field(default_factory=dict)
    # (request id, kind) of every park notice, in order: the pool's timeline (engine/pool_log.py)
    notices: list[tuple[str, str]] = field(default_factory=list)

    def add(self, request_id: str, event: StreamEvent) -> None:
        self.by_request.setdefault(request_id, []).append(event)

    def notice(self, request_id: str, kind: str) -> None:
        """A park notice: ``preempted``, ``resumed`` or ``recomputed``."""
        self.add(request_id, NoticeEvent(kind))
        self.notices.append((request_id, kind))

    def fail(self, request_id: str, message: str, kind: str = "server_error") -> None:
        """The request failed after it was accepted (HTTP 500)."""
        self.add(request_id, ErrorEvent(message, 500, kind))
