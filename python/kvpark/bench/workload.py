"""A seeded, bounded workload: which requests a benchmark level sends, and when.

The same seed gives the same prompts, lengths and arrival offsets on every machine, so two servers
(or two runs of one server) are measured on identical traffic. Prompts are chat messages of random
words from a small fixed vocabulary; ``prompt_tokens`` is approximate (about one token per word for
common English words under a BPE tokenizer); the server's ``usage.prompt_tokens`` says what it
really counted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Common, short English words: each is one token (or close) for Llama/SmolLM/Qwen BPE vocabularies.
_WORD_TEXT = """
the of and to in is you that it he was for on are as with his they at be this have from or one
had by word but not what all were we when your can said there use an each which she do how their
if will up other about out many then them these so some her would make like him into time has
look two more write go see number no way could people my than first water been call who oil its
now find long down day did get come made may part over new sound take only little work know
place year live me back give most very after thing our just name good sentence man think say
great where help through much before line right too mean old any same tell boy follow came want
show also around form three small set put end does another well large must big even such because
turn here why ask went men read need land different home us move try kind hand picture again
change off play spell air away animal house point page letter mother answer found study still
learn should world high every near add food between own below country plant last school father
keep tree never start city earth eye light thought head under story saw left few while along
might close something seem next hard open example begin life always those both paper together
got group often run important until children side feet car mile night walk white sea began grow
took river four carry state once book hear stop without second late
"""
_WORDS = tuple(_WORD_TEXT.split())

ARRIVALS = ("closed", "poisson")


@dataclass(frozen=True)
class WorkloadConfig:
    """What one level sends: ``requests`` chats of ~``prompt_tokens`` tokens, ``max_tokens`` out.

    ``arrival`` is ``closed`` (every request is ready at time 0; ``concurrency`` workers keep that
    many in flight) or ``poisson`` (requests arrive at seeded exponential gaps of mean ``1 / rate``
    seconds, still never more than ``concurrency`` in flight).
    """

    requests: int
    prompt_tokens: int = 64
    max_tokens: int = 64
    seed: int = 0
    arrival: str = "closed"
    rate: float = 0.0  # requests per second, for ``poisson``
    endpoint: str = "chat"  # chat -> /v1/chat/completions, completions -> /v1/completions
    tag: str = ""  # mixed into the seed, so that two levels of one run send different prompts

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("requests must be at least 1")
        if self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be at least 1")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}")
        if self.arrival == "poisson" and self.rate <= 0:
            raise ValueError("a poisson arrival needs rate > 0")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError("endpoint must be chat or completions")


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: its index, prompt text, output length and arrival offset."""

    index: int
    prompt: str
    max_tokens: int
    arrival_s: float  # seconds after the level starts at which the request may be sent
    # a whole conversation to send instead of ``prompt`` as one user message (multiturn)
    messages: tuple[dict[str, str], ...] | None = None


def prompt_text(seed: int, index: int, words: int, tag: str = "") -> str:
    """The prompt of request ``index`` under ``seed``: an instruction, then ``words`` random words.

    Each request draws from its own generator, so request ``i`` is the same whatever the level size.
    """
    return f"Write a long story that uses these words: {word_text(seed, index, words, tag)}"


def word_text(seed: int, index: int, words: int, tag: str = "") -> str:
    """``words`` seeded random words and nothing else: what :func:`prompt_text` puts after its
    instruction, and a prompt that shares no prefix with another (a prefill measure's)."""
    rng = random.Random(f"kvpark-bench/{seed}/{tag}/{index}")
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def build_requests(config: WorkloadConfig) -> list[RequestSpec]:
    """Every request of one level, in sending order."""
    # The instruction prefix costs about 10 tokens; the rest is words, at least one.
    words = max(1, config.prompt_tokens - 10)
    arrivals = arrival_offsets(config)
    return [
        RequestSpec(i, prompt_text(config.seed, i, words, config.tag), config.max_tokens, at)
        for i, at in enumerate(arrivals)
    ]


def arrival_offsets(config: WorkloadConfig) -> list[float]:
    """Seconds after the level's start at which each request arrives (non-decreasing)."""
    if config.arrival == "closed":
        return [0.0] * config.requests
    rng = random.Random(f"kvpark-bench-arrivals/{config.seed}/{config.tag}")
    offsets, now = [], 0.0
    for _ in range(config.requests):
        offsets.append(now)
        now += rng.expovariate(config.rate)
    return offsets


def default_requests_per_level(concurrency: int, cap: int = 64) -> int:
    """Enough requests that every worker runs about twice: ``2 × concurrency``, 4 to ``cap``."""
    return max(4, min(cap, 2 * concurrency))
