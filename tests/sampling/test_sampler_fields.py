"""logit_bias, min_tokens and repetition_penalty: the sampler's arithmetic on small logits, the
fields' effect on the real default model's greedy output, and every validation error."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

import kvpark
from kvpark import SamplingParams
from kvpark.engine.llm_engine import RequestRejected
from kvpark.sampling.params import Constraint, InvalidParameterError
from kvpark.sampling.sampler import NO_TOKEN, SampleRow, make_generator, sample_rows

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


def draw(logits: list[float], p: SamplingParams, **row: object) -> int:
    rows = [SampleRow(p, [make_generator(1, 0)], **row)]  # type: ignore[arg-type]
    return sample_rows(torch.tensor([logits]), rows)[0][0][0]


def test_repetition_penalty_is_the_ctrl_rule() -> None:
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # positive logits are divided: 3.0 -> 1.5 loses to the unseen 2.5
    assert draw([3.0, 2.5, -1.0], p, output_ids=[], prompt_ids=[0]) == 1
    # negative logits are multiplied: -1.0 -> -2.0 loses to the unseen -1.5
    assert draw([-1.0, -1.5], p, output_ids=[0], prompt_ids=[0, 0]) == 1
    # once per token, whatever its count: 3.0 seen five times is 1.5, still above 1.4
    assert draw([3.0, 1.4], p, output_ids=[0, 0, 0], prompt_ids=[0, 0]) == 0
    assert draw([3.0, 2.5], SamplingParams(temperature=0.0), output_ids=[0], prompt_ids=[0]) == 0


def test_logit_bias_comes_before_the_masks_and_penalties() -> None:
    lifted = SamplingParams(temperature=0.0, logit_bias=((2, 5.0),))
    assert draw([1.0, 2.0, 0.0], lifted, output_ids=[]) == 2
    # the grammar's mask wins over any bias
    allowed = torch.tensor([True, True, False])
    assert draw([1.0, 2.0, 0.0], lifted, output_ids=[], allowed=allowed) == 1
    # a bias then the presence penalty: 0.0 + 5.0 - 2.0 = 3.0 still beats 2.0
    both = SamplingParams(temperature=0.0, logit_bias=((2, 5.0),), presence_penalty=2.0)
    assert draw([1.0, 2.0, 0.0], both, output_ids=[2]) == 2


def test_masks_apply_to_sampled_rows_and_leave_raw_logprobs() -> None:
    p = SamplingParams(temperature=1.0, logprobs=0)
    allowed = torch.tensor([False, False, True, False])
    logits = torch.tensor([[9.0, 9.0, 0.0, 9.0]])
    for seed in range(5):
        row = SampleRow(p, [make_generator(seed, 0)], [], allowed=allowed)
        ((token, lp),) = sample_rows(logits, [row])[0]
        assert token == 2
        assert lp is not None and lp.logprob == pytest.approx(
            float(torch.log_softmax(logits[0], -1)[2])
        )


def test_a_row_with_nothing_left_draws_the_dead_end() -> None:
    p = SamplingParams(temperature=0.7)
    none = torch.tensor([True, False, False])
    row = SampleRow(p, [make_generator(0, 0), make_generator(0, 1)], [], allowed=none, banned=(0,))
    assert sample_rows(torch.tensor([[1.0, 2.0, 3.0]]), [row])[0] == [(NO_TOKEN, None)] * 2


@pytest.fixture(scope="module")
def llm() -> Iterator[kvpark.LLM]:
    torch.set_num_threads(1)
    yield kvpark.LLM(dtype="float32", kv_cells=2048, parallel=4)


def tokens(llm: kvpark.LLM, prompt: str, p: SamplingParams) -> list[int]:
    out = llm.generate(prompt, p)[0]
    assert out.error is None, out.error
    return out.token_ids


def test_logit_bias_forces_and_forbids_a_token(llm: kvpark.LLM) -> None:
    prompt = "The capital of France is"
    plain = tokens(llm, prompt, GREEDY)
    forced = llm.engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert forced not in plain
    assert set(tokens(llm, prompt, replace(GREEDY, logit_bias=((forced, 100.0),)))) == {forced}
    banned = tokens(
        llm,
        prompt,
        SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias=((plain[0], -100.0),)
        ),
    )
    assert banned[0] != plain[0] and plain[0] not in banned


def test_min_tokens_holds_back_a_stop_token(llm: kvpark.LLM) -> None:
    prompt = "Count: one, two, three, four,"
    plain = tokens(llm, prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    stop = plain[2]
    first = plain.index(stop)
    early = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop,))
    )[0]
    assert early.token_ids == plain[: first + 1] and early.choices[0].finish_reason == "stop"
    late = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop,), min_tokens=8)
    )[0]
    assert len(late.token_ids) >= 8 and stop not in late.token_ids[:7]


def test_min_tokens_holds_back_eos(llm: kvpark.LLM) -> None:
    tok = llm.engine.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    short = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=60))[0]
    assert short.choices[0].finish_reason == "stop" and len(short.token_ids) < 30  # ends by EOS
    held = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=60, min_tokens=40))[0]
    assert len(held.token_ids) >= 40
    assert not set(held.token_ids[:39]) & tok.eos_ids


def test_repetition_penalty_breaks_a_greedy_loop(llm: kvpark.LLM) -> None:
    prompt = "a b a b a b a b a b a b"
    plain = tokens(llm, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert len(set(plain)) < len(plain) // 2  # the model loops
    penalised = tokens(
        llm,
        prompt,
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8),
    )
    assert penalised != plain and len(set(penalised)) > len(set(plain))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": ((5, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((49152, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((5, float("nan")),)}, "logit_bias"),
        ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"constraint": Constraint("xml", "", "response_format")}, "response_format"),  # type: ignore[arg-type]
    ],
)
def test_each_validation_error_names_its_field(fields: dict[str, object], param: str) -> None:
    p = SamplingParams(**fields)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError) as e:
        p.validate(49152)
    assert e.value.param == param


def test_the_engine_answers_a_400_naming_the_field(llm: kvpark.LLM) -> None:
    ids = llm.engine.tokenizer.encode("Hi")
    with pytest.raises(RequestRejected) as e:
        llm.engine.check_request(ids, SamplingParams(repetition_penalty=3.0))
    assert e.value.code == 400 and e.value.param == "repetition_penalty"
    SamplingParams(logit_bias=((5, -100.0),), min_tokens=16, repetition_penalty=2.0).validate(49152)
