"""Turns a step's logits into tokens, one row at a time, each with its own generator.

Order of processing, as vLLM and llama.cpp apply it: presence/frequency penalties, temperature,
top-k, top-p, min-p, then a draw from the request's own ``torch.Generator``. Greedy rows take the
argmax. Logprobs are those of the model's raw distribution (log-softmax of the logits before any
processing), as the OpenAI API reports them.

Each row is processed on its own, so its result never depends on which other rows share the step.

Draws happen on the CPU, whatever the model's device: a request's generator is a CPU generator (so
its stream is the same on every device and a park cannot perturb it), and ``torch.multinomial``
refuses a generator of another device than its input. The rows that draw come to the host in one
copy per step; greedy rows and logprobs stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpark.sampling.logprob import TokenLogprob
from kvpark.sampling.params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    generators: list[torch.Generator]  # one per draw; several when a prompt forks into n choices
    output_ids: list[int]  # tokens generated so far (for the penalties)


def make_generator(seed: int, choice: int) -> torch.Generator:
    """A CPU generator per choice; derived so that choice j of seed s is stable across runs."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + choice) % (2**63))
    return g


def sample_rows(
    logits: torch.Tensor, rows: list[SampleRow]
) -> list[list[tuple[int, TokenLogprob | None]]]:
    """``logits`` [S, vocab] on any device; returns per row the drawn (token, logprob) pairs."""
    logits = logits.float()
    results: list[list[tuple[int, TokenLogprob | None]]] = []
    greedy_argmax: list[int] | None = None
    if any(r.params.greedy and not _has_penalty(r.params) for r in rows):
        greedy_argmax = logits.argmax(dim=-1).tolist()
    drawing = [i for i, r in enumerate(rows) if not r.params.greedy]
    on_host = dict(zip(drawing, _to_host(logits, drawing), strict=True))
    for i, row in enumerate(rows):
        raw = logits[i]
        p = row.params
        draws: list[int]
        if p.greedy and not _has_penalty(p):
            assert greedy_argmax is not None
            draws = [greedy_argmax[i]] * len(row.generators)
        elif p.greedy:
            draws = [int(_apply_penalties(raw, row.output_ids, p).argmax())] * len(row.generators)
        else:
            probs = _filtered_probs(_apply_penalties(on_host[i], row.output_ids, p), p)
            draws = [int(torch.multinomial(probs, 1, generator=g)) for g in row.generators]
        lp = _logprobs(raw, draws, p.logprobs) if p.logprobs is not None else [None] * len(draws)
        results.append(list(zip(draws, lp, strict=True)))
    return results


def _to_host(logits: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """Rows ``rows`` of ``logits`` on the CPU, where the generators are: one copy for all."""
    if not rows:
        return []
    if logits.device.type == "cpu":
        return [logits[i] for i in rows]
    return list(logits[torch.tensor(rows, device=logits.device)].cpu())


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _apply_penalties(raw: torch.Tensor, output_ids: list[int], p: SamplingParams) -> torch.Tensor:
    if not _has_penalty(p) or not output_ids:
        return raw
    counts = torch.bincount(torch.tensor(output_ids, device=raw.device), minlength=raw.shape[0])
    counts = counts[: raw.shape[0]].to(raw.dtype)
    out = raw - p.frequency_penalty * counts
    return out - p.presence_penalty * (counts > 0).to(raw.dtype)


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (cum - sorted_probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def _logprobs(raw: torch.Tensor, draws: list[int], top_n: int) -> list[TokenLogprob | None]:
    logp = torch.log_softmax(raw, dim=-1)
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = torch.topk(logp, top_n)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    chosen = logp[torch.tensor(draws, device=logp.device)].tolist()
    return [TokenLogprob(t, float(v), top) for t, v in zip(draws, chosen, strict=True)]
