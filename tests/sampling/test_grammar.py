"""Structured output on the real default model through ``kvpark.LLM``: each constraint kind makes
the output match it (greedy and sampled), a bad constraint is refused naming its field, a grammar
that cannot go on ends with ``grammar_dead_end``, and n choices each follow their own grammar."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

import kvpark
from kvpark import SamplingParams
from kvpark.engine.llm_engine import RequestRejected
from kvpark.sampling.grammar import DEAD_END, unpack_bitmask
from kvpark.sampling.params import Constraint


class Person(BaseModel):
    """The pydantic twin of SCHEMA: what a valid output must parse into."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(max_length=20)
    age: int
    tags: list[str] = Field(max_length=3)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPT = "Describe a person called Bob, aged 30, who likes chess, as JSON."


@pytest.fixture(scope="module")
def llm() -> Iterator[kvpark.LLM]:
    torch.set_num_threads(1)
    yield kvpark.LLM(dtype="float32", kv_cells=2048, parallel=4)


def params(c: Constraint, temperature: float = 0.0, **kw: object) -> SamplingParams:
    kw.setdefault("max_tokens", 80)
    return SamplingParams(temperature=temperature, seed=7, constraint=c, **kw)  # type: ignore[arg-type]


def one(llm: kvpark.LLM, prompt: str, p: SamplingParams) -> tuple[str, str | None]:
    out = llm.generate(prompt, p)[0]
    assert out.error is None, out.error
    return out.choices[0].text, out.choices[0].finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(llm: kvpark.LLM, temperature: float) -> None:
    c = Constraint("json_schema", json.dumps(SCHEMA))
    text, reason = one(llm, PROMPT, params(c, temperature))
    assert reason == "stop"
    Person.model_validate_json(text)  # raises unless the schema holds


def test_json_object_output_is_an_object(llm: kvpark.LLM) -> None:
    text, reason = one(llm, PROMPT, params(Constraint("json_object"), 1.0))
    assert reason == "stop" and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("temperature", [0.0, 1.2])
def test_regex_output_fullmatches(llm: kvpark.LLM, temperature: float) -> None:
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}-[0-9]{4}"
    c = Constraint("regex", pattern, "guided_regex")
    text, reason = one(llm, "Give a name and a code.", params(c, temperature))
    assert reason == "stop" and re.fullmatch(pattern, text), text


def test_choice_output_is_one_of_them(llm: kvpark.LLM) -> None:
    choices = ["positive", "negative", "not sure"]
    c = Constraint("choice", json.dumps(choices), "guided_choice")
    for temperature in (0.0, 1.5):
        text, reason = one(llm, "Is this review positive? 'Loved it.'", params(c, temperature))
        assert reason == "stop" and text in choices


def test_gbnf_and_lark_grammars(llm: kvpark.LLM) -> None:
    gbnf = 'root ::= "Answer: " ("yes" | "no") ", because " [a-z ]{3,30} "."'
    text, reason = one(llm, "Is water wet?", params(Constraint("gbnf", gbnf, "grammar"), 1.0))
    assert reason == "stop" and re.fullmatch(r"Answer: (yes|no), because [a-z ]{3,30}\.", text)
    # at most four numbers: an open list at temperature 1 may run past max_tokens
    lark = 'start: "[" NUM ("," NUM)? ("," NUM)? ("," NUM)? "]"\nNUM: /[0-9]{1,3}/'
    text, reason = one(llm, "Some numbers:", params(Constraint("lark", lark, "grammar"), 1.0))
    assert reason == "stop" and re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3}){0,3}\]", text), text


def test_n_choices_each_follow_the_grammar(llm: kvpark.LLM) -> None:
    c = Constraint("json_schema", json.dumps(SCHEMA))
    out = llm.generate(PROMPT, params(c, 1.0, n=3))[0]
    assert len(out.choices) == 3
    texts = [ch.text for ch in out.choices]
    for ch in out.choices:
        assert ch.finish_reason == "stop"
        Person.model_validate_json(ch.text)
    assert len(set(texts)) > 1  # three generators drew three answers, each valid on its own


def test_max_tokens_still_cuts_with_length(llm: kvpark.LLM) -> None:
    c = Constraint("json_schema", json.dumps(SCHEMA))
    out = llm.generate(PROMPT, params(c, max_tokens=5))[0]
    assert out.choices[0].finish_reason == "length" and len(out.choices[0].token_ids) == 5


def test_a_grammar_whose_end_min_tokens_forbids_is_a_dead_end(llm: kvpark.LLM) -> None:
    c = Constraint("regex", "(yes|no)", "guided_regex")
    out = llm.generate("Answer yes or no.", params(c, min_tokens=4, max_tokens=20))[0]
    choice = out.choices[0]
    assert choice.finish_reason == DEAD_END  # finished at once, not at max_tokens
    assert choice.text in ("yes", "no") and len(choice.token_ids) < 4
    assert not llm.engine.has_work and llm.engine.scheduler.pool.cells_used() == 0


@pytest.mark.parametrize(
    ("constraint", "field", "words"),
    [
        (Constraint("json_schema", '{"type": "strnig"}'), "response_format", "JSON schema"),
        (Constraint("json_schema", "{not json", "guided_json"), "guided_json", "not JSON"),
        (Constraint("json_schema", "[1, 2]", "json_schema"), "json_schema", "not a JSON object"),
        (Constraint("regex", "[0-9", "guided_regex"), "guided_regex", "regular expression"),
        (Constraint("gbnf", "root ::= missing", "grammar"), "grammar", "GBNF"),
        (Constraint("gbnf", 'root ::= "a', "grammar"), "grammar", "GBNF"),
        (Constraint("lark", "start: undefined_rule", "grammar"), "grammar", "Lark"),
        (Constraint("choice", "[]", "guided_choice"), "guided_choice", "non-empty"),
        (Constraint("choice", '["a", 3]', "guided_choice"), "guided_choice", "strings"),
    ],
)
def test_a_bad_constraint_is_refused_naming_its_field(
    llm: kvpark.LLM, constraint: Constraint, field: str, words: str
) -> None:
    ids = llm.engine.tokenizer.encode("Hi")
    with pytest.raises(RequestRejected) as e:
        llm.engine.check_request(ids, SamplingParams(constraint=constraint))
    assert e.value.code == 400 and e.value.param == field and words in e.value.message


def test_min_tokens_that_a_grammar_can_never_meet_is_refused(llm: kvpark.LLM) -> None:
    ids = llm.engine.tokenizer.encode("Hi")
    c = Constraint("regex", "", "guided_regex")  # only the empty string: its end comes first
    with pytest.raises(RequestRejected) as e:
        llm.engine.check_request(ids, SamplingParams(constraint=c, min_tokens=1))
    assert e.value.param == "min_tokens"


def test_the_same_constraint_is_compiled_once(llm: kvpark.LLM) -> None:
    c = Constraint("regex", "a[0-9]", "guided_regex")
    grammars = llm.engine.grammars
    first = grammars.state(c)
    assert first.advance(llm.engine.tokenizer.encode("a", add_special_tokens=False)[0])
    cached = len(grammars._pristine)
    second = grammars.state(c)  # a copy of the pristine matcher, at the start again
    assert len(grammars._pristine) == cached
    assert np.array_equal(second.allowed(100), grammars.state(c).allowed(100))
    assert not np.array_equal(first.allowed(49152), second.allowed(49152))


def test_unpack_bitmask_bit_order_and_padding() -> None:
    words = np.array([0b101, -(2**31) | 1], dtype=np.int32)  # bits 0 and 31 of word 1
    bits = unpack_bitmask(words, 40, 48)
    assert bits.shape == (48,)
    assert np.flatnonzero(bits).tolist() == [0, 2, 32]  # 63 is past the vocabulary
