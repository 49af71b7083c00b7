"""A sampled token's logprob and its top alternatives: what sampling reports beside the token."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives (token id, logprob), best first
