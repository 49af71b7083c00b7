"""The soak's traffic, drawn from one seed: which requests it sends, in what groups, and what
each is expected to get.

Every request is one of three kinds:

- ``good``: a chat or completion, streamed or not, ``n`` 1-3, greedy or seeded sampling, a short
  or long prompt that starts with one of a few shared prefixes (so the prefix cache and the parks
  of shared pages are in play). Some streams are read slowly. Each must end exactly as it does
  alone on an idle server, unless an injected fault hit its step.
- ``bad``: a body the server must refuse with a 400 and a JSON error (an unknown field, a wrong
  type, an out-of-range value, a lone surrogate, nesting deeper than the parser recurses, broken
  JSON, no messages, token ids outside the vocabulary).
- ``disconnect``: a stream whose client hangs up after a drawn number of events; these come in
  bursts of 10-20 sent at once.

The plan is a list of entries, each one request or one burst; the runner keeps ``concurrency``
entries in flight.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from kvpark.bench.workload import word_text

GOOD, BAD, DISCONNECT = "good", "bad", "disconnect"
BURST = (10, 20)  # clients per disconnect burst
SHORT_PREFIX_WORDS, LONG_PREFIX_WORDS = 12, 160
PREFIXES = 3  # shared prefixes of each length
MAX_N = 3
DEEP = 100_000  # nesting of the deep-nesting body: far past any JSON parser's recursion


@dataclass(frozen=True)
class SoakRequest:
    """One request. ``body`` is JSON for ``good`` and ``disconnect`` and most ``bad`` ones;
    ``raw`` (bytes sent as they are) for a bad body that JSON cannot express."""

    index: int
    kind: str
    endpoint: str  # chat | completions
    stream: bool
    body: dict[str, Any] = field(default_factory=dict)
    raw: bytes | None = None
    bad: str = ""  # which bad input
    param: str | None = None  # the field a 400 must name, where the server names one
    slow: bool = False  # read a stream 1 KiB at a time with pauses
    cut_after: int = 0  # disconnect: events read before hanging up
    category: str = ""  # a label for the report: "chat/stream/n2/seeded/long" ...

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def content(self) -> bytes:
        return self.raw if self.raw is not None else json.dumps(self.body).encode()

    def reference_body(self) -> dict[str, Any]:
        """The same request, not streamed: what the idle reference server is sent."""
        body = {k: v for k, v in self.body.items() if k not in ("stream", "stream_options")}
        return body


@dataclass(frozen=True)
class SoakPlan:
    seed: int
    entries: list[list[SoakRequest]]  # each entry: one request, or a burst sent at once
    max_tokens: int

    @property
    def requests(self) -> list[SoakRequest]:
        return [r for entry in self.entries for r in entry]

    def max_cells(self) -> int:
        """A generous bound on the cells one request needs alone (about 1.6 tokens a word)."""
        words = LONG_PREFIX_WORDS + 40
        return int(words * 1.6) + 64 + MAX_N * self.max_tokens


def _prefixes(seed: int) -> dict[str, list[str]]:
    return {
        "short": [word_text(seed, i, SHORT_PREFIX_WORDS, "soak-short") for i in range(PREFIXES)],
        "long": [word_text(seed, i, LONG_PREFIX_WORDS, "soak-long") for i in range(PREFIXES)],
    }


def _good(
    rng: random.Random,
    index: int,
    model: str,
    prefixes: dict[str, list[str]],
    max_tokens: int,
    disconnect: bool = False,
) -> SoakRequest:
    endpoint = "chat" if rng.random() < 0.6 else "completions"
    stream = disconnect or rng.random() < 0.5
    n = 1 if disconnect else rng.choice((1, 1, 1, 2, 3))
    seeded = rng.random() < 0.5
    length = "long" if rng.random() < 0.4 else "short"
    question = word_text(rng.randrange(1 << 30), index, rng.randint(3, 12), "soak-q")
    text = f"{rng.choice(prefixes[length])}\n\nNow write about: {question}"
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(4, max_tokens), "n": n}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if seeded:
        body.update(temperature=0.9, top_p=0.95, seed=rng.randrange(1 << 31))
    else:
        body["temperature"] = 0.0
    if rng.random() < 0.5:
        body["ignore_eos"] = True  # the rest may stop early at the end-of-turn token
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    kind = DISCONNECT if disconnect else GOOD
    slow = stream and not disconnect and rng.random() < 0.25
    cut = rng.randint(1, 8) if disconnect else 0
    label = "/".join(
        [
            endpoint,
            "stream" if stream else "plain",
            f"n{n}",
            "seeded" if seeded else "greedy",
            length,
        ]
        + (["slow"] if slow else [])
    )
    return SoakRequest(
        index, kind, endpoint, stream, body, slow=slow, cut_after=cut, category=label
    )


def _bad(kind: str, index: int, model: str) -> SoakRequest:
    """One of the bad inputs, each refused with a 400 (``param`` named where the server can)."""
    chat: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    raw: bytes | None = None
    param: str | None = None
    endpoint = "chat"
    body = dict(chat)
    if kind == "unknown_field":
        body["frobnicate"], param = True, "frobnicate"
    elif kind == "wrong_type":
        body["max_tokens"], param = "many", "max_tokens"
    elif kind == "out_of_range":
        body["temperature"], param = -1.0, "temperature"
    elif kind == "n_zero":
        body["n"], param = 0, "n"
    elif kind == "no_messages":
        body["messages"], param = [], "messages"
    elif kind == "lone_surrogate":
        raw = b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}' % (
            model.encode()
        )
        param = "messages[0].content"
    elif kind == "deep_nesting":
        raw = b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    elif kind == "broken_json":
        raw = b'{"model": "' + model.encode() + b'", "messages": [{"role": '
    elif kind == "bad_token_ids":
        endpoint, body, param = "completions", {"model": model, "prompt": [10**9]}, "prompt"
    return SoakRequest(
        index, BAD, endpoint, False, body, raw=raw, bad=kind, param=param, category=f"bad/{kind}"
    )


BAD_KINDS = (
    "unknown_field",
    "wrong_type",
    "out_of_range",
    "n_zero",
    "no_messages",
    "lone_surrogate",
    "deep_nesting",
    "broken_json",
    "bad_token_ids",
)


def build_plan(seed: int, requests: int, model: str, max_tokens: int = 24) -> SoakPlan:
    """``requests`` requests (at least 60 gives every category) from ``seed``: every ninth
    single one bad (more often in a short plan, so that every kind comes; the kinds in a seeded
    order, in turn), disconnect bursts of 10-20 making up about a quarter, the rest good.

    The first burst comes after a fifth of the requests, so the warm-up wave has good traffic;
    bursts are spread evenly after that."""
    if requests < 1:
        raise ValueError("the soak needs at least one request")
    rng = random.Random(f"kvpark-soak/{seed}")
    prefixes = _prefixes(seed)
    bursts = max(1, round(requests * 0.25 / 15)) if requests >= 40 else 0
    burst_sizes = [rng.randint(*BURST) for _ in range(bursts)]
    while bursts and sum(burst_sizes) > requests // 2:
        burst_sizes = [max(BURST[0], s - 1) for s in burst_sizes]
        if all(s == BURST[0] for s in burst_sizes):
            break
    singles = requests - sum(burst_sizes)
    burst_at = {
        max(1, singles // 5) + k * max(1, (singles - singles // 5) // max(1, bursts))
        for k in range(bursts)
    }
    bad_kinds = list(BAD_KINDS)
    rng.shuffle(bad_kinds)
    every = max(2, min(9, singles // (len(bad_kinds) + 1)))  # every kind, even in a short plan
    entries: list[list[SoakRequest]] = []
    index = 0
    for position in range(singles):
        if position in burst_at and burst_sizes:
            size = burst_sizes.pop()
            burst = [
                _good(rng, index + i, model, prefixes, max_tokens, disconnect=True)
                for i in range(size)
            ]
            entries.append(burst)
            index += size
        if position % every == every // 2:
            entries.append([_bad(bad_kinds[(position // every) % len(bad_kinds)], index, model)])
        else:
            entries.append([_good(rng, index, model, prefixes, max_tokens)])
        index += 1
    return SoakPlan(seed, entries, max_tokens)
