"""Sampler on hand-made logits: every filter, both penalties, generators, logprobs."""

from __future__ import annotations

import math

import torch

from kvpark.sampling.params import SamplingParams
from kvpark.sampling.sampler import SampleRow, make_generator, sample_rows

LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])


def draws(
    params: SamplingParams,
    n: int = 400,
    output_ids: list[int] | None = None,
    logits: torch.Tensor = LOGITS,
) -> set[int]:
    gens = [make_generator(7, j) for j in range(n)]
    row = SampleRow(params, gens, output_ids or [])
    return {t for t, _ in sample_rows(logits, [row])[0]}


def test_greedy_takes_the_argmax() -> None:
    assert draws(SamplingParams(temperature=0.0), n=3) == {0}


def test_greedy_rows_take_torchs_argmax_ties_and_nans_included() -> None:
    """The greedy fast path (numpy's argmax on the CPU) picks what ``torch.argmax`` does: the
    first of equal maxima, the first NaN, the first +inf; each row on its own."""
    torch.manual_seed(0)
    logits = torch.randn(6, 49152)
    logits[1, [70, 9000]] = float("nan")
    logits[2] = 0.5  # all tied
    logits[3, [11, 40000]] = float("inf")
    logits[4, [5, 6]] = logits[4].max() + 1.0  # a tie at the top
    logits[5] = float("-inf")
    rows = [
        SampleRow(SamplingParams(temperature=0.0), [make_generator(1, 0)], []) for _ in range(6)
    ]
    got = [drawn[0][0] for drawn in sample_rows(logits, rows)]
    assert got == logits.argmax(dim=-1).tolist() == [*got[:1], 70, 0, 11, 5, 0]


def test_top_k_keeps_only_the_k_best() -> None:
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.softmax(LOGITS[0], -1)
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert draws(SamplingParams(temperature=1.0, top_p=0.7)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.01)) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    # p1/p0 = e^-1 ~ 0.37, p2/p0 = e^-2 ~ 0.14
    assert draws(SamplingParams(temperature=1.0, min_p=0.2)) == {0, 1}


def test_all_tokens_reachable_without_filters() -> None:
    assert draws(SamplingParams(temperature=2.0), n=2000) == {0, 1, 2, 3, 4}


def test_frequency_and_presence_penalties_push_repeated_tokens_down() -> None:
    # token 0 already generated 3 times: -3*1.0 frequency, -1.5 presence -> 4 - 4.5 < 3
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=1.5)
    assert draws(p, n=1, output_ids=[0, 0, 0]) == {1}
    assert draws(SamplingParams(temperature=0.0, presence_penalty=0.5), n=1, output_ids=[0]) == {0}
    assert draws(SamplingParams(temperature=0.0, presence_penalty=1.5), n=1, output_ids=[0]) == {1}


def test_same_seed_same_draws_different_seed_different() -> None:
    params = SamplingParams(temperature=1.0)
    big = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))

    def run(seed: int) -> list[int]:
        g = make_generator(seed, 0)
        return [sample_rows(big, [SampleRow(params, [g], [])])[0][0][0] for _ in range(20)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_a_row_does_not_depend_on_its_neighbours() -> None:
    params = SamplingParams(temperature=1.0)
    big = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    alone = sample_rows(big[1:2], [SampleRow(params, [make_generator(3, 0)], [])])
    rows = [SampleRow(params, [make_generator(s, 0)], []) for s in (1, 3, 5)]
    together = sample_rows(big, rows)
    assert together[1] == alone[0]


def test_logprobs_are_raw_model_logprobs() -> None:
    out = sample_rows(
        LOGITS, [SampleRow(SamplingParams(temperature=0.0, logprobs=2), [make_generator(0, 0)], [])]
    )[0][0]
    token, lp = out
    assert lp is not None and token == 0
    expected = torch.log_softmax(LOGITS[0], -1)
    assert math.isclose(lp.logprob, float(expected[0]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [0, 1]


def test_draws_follow_the_filtered_distribution() -> None:
    """20,000 draws from one generator: each token's share within 4.5 standard deviations of its
    probability (softmax at temperature 0.8 over the top 4), and the 5th token, cut by top_k,
    never drawn. The draw inverts the cumulative sum (sampler._draw); an off-by-one there shifts
    mass between neighbours by far more than the bound."""
    params = SamplingParams(temperature=0.8, top_k=4)
    g = make_generator(11, 0)
    n = 20_000
    row = SampleRow(params, [g], [])
    counts = [0] * 5
    for _ in range(n):
        counts[sample_rows(LOGITS.numpy(), [row])[0][0][0]] += 1
    probs = torch.softmax(LOGITS[0, :4] / 0.8, -1).tolist()
    assert counts[4] == 0
    for got, p in zip(counts, probs, strict=False):
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(got - n * p) < 4.5 * sigma, (counts, probs)
