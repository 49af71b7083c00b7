"""Turns a step's logits into tokens, one row at a time, each with its own generator.

Order of processing: ``logit_bias`` added to the logits, then the masks (the grammar's allowed
tokens, EOS and stop ids while ``min_tokens`` is not reached), then the repetition penalty (the CTRL
rule: a logit of a token seen in the prompt or output is divided by the penalty if positive,
multiplied by it if not) and the presence/frequency penalties, then temperature, top-k, top-p, min-p
and a draw from the request's own generator. Greedy rows take the argmax of the same processed
logits. Logprobs are those of the model's raw distribution (log-softmax of the logits before any
processing, bias and grammar included), as the OpenAI API reports them.

A row whose masks leave no token at all draws :data:`NO_TOKEN` instead of a token: the engine ends
the choice with the grammar's dead-end finish reason.

Each row is processed on its own, so its result never depends on which other rows share the step.

Everything here is numpy on the host, whatever the model's device: the step's logits come to the
host in one copy (``host_logits``), a request's generator is a numpy ``Generator`` (PCG64, so its
stream is the same on every machine and a park cannot perturb it: it lives with the request, not
with the runner), and a draw inverts the filtered distribution's cumulative sum at one uniform
number. No torch: the CPU server runs without it (runner/lean_runner.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpark.sampling.logprob import TokenLogprob
from kvpark.sampling.params import SamplingParams

NO_TOKEN = -1  # drawn by a row whose masks leave no token

Logits = npt.NDArray[np.float32]
Generator = np.random.Generator


@dataclass
class SampleRow:
    params: SamplingParams
    generators: list[Generator]  # one per draw; several when a prompt forks into n choices
    output_ids: list[int]  # tokens generated so far (for the penalties)
    prompt_ids: Sequence[int] = ()  # for the repetition penalty, which counts the prompt too
    allowed: npt.ArrayLike | None = None  # bool [vocab]: the tokens the grammar allows next
    banned: tuple[int, ...] = ()  # EOS and stop_token_ids while min_tokens is not reached

    @property
    def plain(self) -> bool:
        """Nothing to apply before the argmax or the draw (the greedy fast path)."""
        p = self.params
        return not (
            _has_penalty(p)
            or p.logit_bias
            or p.repetition_penalty != 1.0
            or self.allowed is not None
            or self.banned
        )


def make_generator(seed: int, choice: int) -> Generator:
    """A generator per choice; derived so that choice j of seed s is stable across runs."""
    return np.random.Generator(np.random.PCG64((seed * 1_000_003 + choice) % (2**63)))


def host_logits(logits: Any) -> Logits:
    """A runner's logits (a numpy array, or a torch tensor on any device) as float32 numpy on the
    host, in one copy at most. Duck-typed: this module never imports torch."""
    if not isinstance(logits, np.ndarray):
        logits = logits.detach().float().cpu().numpy()
    return np.ascontiguousarray(logits, dtype=np.float32)


def sample_rows(logits: Any, rows: list[SampleRow]) -> list[list[tuple[int, TokenLogprob | None]]]:
    """``logits`` [S, vocab] (see ``host_logits``); returns per row the drawn (token, logprob)
    pairs."""
    host = host_logits(logits)
    results: list[list[tuple[int, TokenLogprob | None]]] = []
    greedy_argmax: list[int] | None = None
    if any(r.params.greedy and r.plain for r in rows):
        # numpy's SIMD argmax: ~5 us a row over the default model's 49,152 logits (torch's
        # single-threaded one took ~50); the first of equal maxima, a NaN counting as the largest
        greedy_argmax = host.argmax(axis=-1).tolist()
    for i, row in enumerate(rows):
        raw = host[i]
        p = row.params
        draws: list[int]
        if p.greedy and row.plain:
            assert greedy_argmax is not None
            draws = [greedy_argmax[i]] * len(row.generators)
        else:
            processed = _process(raw, row)
            if processed is None:
                results.append([(NO_TOKEN, None)] * len(row.generators))
                continue
            if p.greedy:
                draws = [int(processed.argmax())] * len(row.generators)
            else:
                cum = np.cumsum(_filtered_probs(processed, p), dtype=np.float64)
                draws = [_draw(cum, g) for g in row.generators]
        lp = _logprobs(raw, draws, p.logprobs) if p.logprobs is not None else [None] * len(draws)
        results.append(list(zip(draws, lp, strict=True)))
    return results


def _draw(cum: npt.NDArray[np.float64], g: Generator) -> int:
    """The token whose interval of the cumulative sum holds one uniform number: a token of
    probability 0 has an empty interval and is never drawn."""
    at = float(g.random()) * float(cum[-1])
    return min(int(np.searchsorted(cum, at, side="right")), int(cum.shape[0]) - 1)


def _process(logits: Logits, row: SampleRow) -> Logits | None:
    """Bias, masks and penalties applied to one row (a copy); None when no token is left."""
    p = row.params
    out = logits.copy()
    if p.logit_bias:
        ids = np.array([t for t, _ in p.logit_bias], dtype=np.int64)
        np.add.at(out, ids, np.array([b for _, b in p.logit_bias], dtype=np.float32))
    masked = row.allowed is not None or bool(row.banned)
    if row.allowed is not None:
        out[~np.asarray(row.allowed, dtype=np.bool_)] = -np.inf
    if row.banned:
        out[list(row.banned)] = -np.inf
    if masked and not bool(np.isfinite(out).any()):
        return None
    if p.repetition_penalty != 1.0:
        _repetition_penalty(out, [*row.prompt_ids, *row.output_ids], p.repetition_penalty)
    return _apply_penalties(out, row.output_ids, p)


def _repetition_penalty(logits: Logits, seen: list[int], penalty: float) -> None:
    """The CTRL rule (as Hugging Face and vLLM apply it), in place: each token seen once or more
    is penalised once, whatever its count."""
    if not seen:
        return
    ids = np.unique(np.array(seen, dtype=np.int64))
    picked = logits[ids]
    logits[ids] = np.where(picked > 0, picked / np.float32(penalty), picked * np.float32(penalty))


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _apply_penalties(raw: Logits, output_ids: list[int], p: SamplingParams) -> Logits:
    if not _has_penalty(p) or not output_ids:
        return raw
    counts = np.bincount(np.array(output_ids, dtype=np.int64), minlength=raw.shape[0])
    counts = counts[: raw.shape[0]].astype(np.float32)
    out: Logits = raw - np.float32(p.frequency_penalty) * counts
    return out - np.float32(p.presence_penalty) * (counts > 0).astype(np.float32)


def _filtered_probs(logits: Logits, p: SamplingParams) -> Logits:
    scaled = logits / np.float32(p.temperature)
    if 0 < p.top_k < scaled.shape[0]:
        kth = np.partition(scaled, -p.top_k)[-p.top_k]
        scaled[scaled < kth] = -np.inf
    probs = _softmax(scaled)
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        cum = np.cumsum(sorted_probs)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = np.empty(probs.shape, dtype=np.bool_)
        drop[order] = (cum - sorted_probs) >= p.top_p
        probs[drop] = 0.0
    if p.min_p > 0.0:
        probs[probs < np.float32(p.min_p) * probs.max()] = 0.0
    return probs


def _softmax(x: Logits) -> Logits:
    e: Logits = np.exp(x - x.max())
    out: Logits = e / e.sum(dtype=np.float32)
    return out


def _log_softmax(x: Logits) -> Logits:
    shifted: Logits = x - x.max()
    out: Logits = shifted - np.log(np.exp(shifted).sum(dtype=np.float32))
    return out


def _logprobs(raw: Logits, draws: list[int], top_n: int) -> list[TokenLogprob | None]:
    logp = _log_softmax(raw)
    top: list[tuple[int, float]] = []
    if top_n > 0:
        n = min(top_n, logp.shape[0])
        best = np.argpartition(-logp, n - 1)[:n]
        best = best[np.lexsort((best, -logp[best]))]  # by logprob, then id
        top = list(zip(best.tolist(), logp[best].tolist(), strict=True))
    chosen = logp[np.array(draws, dtype=np.int64)].tolist()
    return [TokenLogprob(t, float(v), top) for t, v in zip(draws, chosen, strict=True)]
