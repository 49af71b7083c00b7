"""A request and its sequences: token bookkeeping only, no tensors.

A request holds one prompt and ``n`` choices. While its prompt is being computed it has a single
sequence; when the prompt's last row is sampled, the sequence forks into ``n`` (they share the
prompt's pages). A sequence's *known* tokens are prompt + output; its *computed* tokens are those
whose K and V sit in the pool. Every step moves computed tokens towards known ones — a prompt chunk,
a decode token and a recompute replay are the same catch-up.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvpark.core import ParkMode as ParkMode
from kvpark.sampling.params import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"  # admitted to the queue, holds no cells
    RUNNING = "running"  # holds cells; prefill or decode
    PARKED = "parked"  # out of the pool: swapped to host memory or dropped for a replay
    PARKING = "parking"  # a swap's copy out is in flight: it keeps its cells, takes no step
    RESTORING = "restoring"  # a swap's copy back is in flight into cells it holds; no step yet
    FINISHED = "finished"


@dataclass
class Sequence:
    """One choice of a request; ``seq_id`` is its id in the Rust pool."""

    seq_id: int
    index: int  # choice index, 0..n-1
    prompt_len: int
    tokens: list[int]  # prompt followed by output, shared prompt list copied at fork
    num_computed: int = 0
    finish_reason: str | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def pending_rows(self) -> int:
        """Known tokens whose K and V are not in the pool yet."""
        return len(self.tokens) - self.num_computed


@dataclass
class ParkRecord:
    """A request's parks: how many, the current one's mode and times, what it must restore."""

    parks: int = 0
    recomputes: int = 0
    mode: ParkMode | None = None  # set while parked
    parked_at: float = 0.0
    resumed_at: float | None = None
    output_at_resume: int = 0  # tokens generated when it last resumed (rotation protection)
    # a recompute resume replays its tokens first: its residency (rotation protection) starts
    # when the replay has caught up, or a replay longer than 2 s would leave it rotatable at once
    replaying: bool = False
    dropped: int = 0  # cells a recompute park dropped: replayed on resume
    released: int = 0  # a swap park's first cells, behind the sliding window: never saved
    window_released: int = 0  # the same in the window space (sched/window_space.py)
    buffer_slot: int | None = None  # the slot whose host buffer a swap park used
    copy_started: float = 0.0  # perf_counter() when the current copy out or back was issued


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the effective seed: params.seed or one drawn by the engine
    key: int = 0  # arrival order, also the request's id for the Rust planner
    arrival: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.WAITING
    sequences: list[Sequence] = field(default_factory=list)
    first_token_time: float | None = None
    prefill_done_time: float | None = None
    last_token_time: float | None = None
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied at admission
    park: ParkRecord = field(default_factory=lambda: ParkRecord())

    @property
    def parks(self) -> int:
        return self.park.parks

    @property
    def recomputes(self) -> int:
        return self.park.recomputes

    @property
    def live_sequences(self) -> list[Sequence]:
        return [s for s in self.sequences if not s.finished]

    @property
    def finished(self) -> bool:
        return bool(self.sequences) and all(s.finished for s in self.sequences)
