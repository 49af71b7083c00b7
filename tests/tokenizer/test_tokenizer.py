"""Our tokenizer (built from GGUF metadata) against transformers' AutoTokenizer on the same file,
and the incremental detokenizer against a full decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpark.model.gguf_loader import GgufFile
from kvpark.tokenizer.detokenizer import IncrementalDetokenizer
from kvpark.tokenizer.tokenizer import PromptTooLong, Tokenizer

TEXTS = [
    "",
    "Hello world",
    "  leading, trailing   and   multiple spaces  ",
    "line one\nline two\n\n\tindented\r\nwindows line",
    "日本語のテキストと中文混合，还有标点。",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "def square(x):\n    return x ** 2  # comment\n\nprint(square(12))\n",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n",
    "don't won't I'll we've THEY'RE",
    "numbers 1234567 and 3.14159, 2024-11-30",
    "non\u00a0breaking\u00a0space and Ünïcödé àccents",
    "x" * 300,
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
    [
        {"role": "user", "content": "日本語 😀"},
        {"role": "assistant", "content": "はい", "name": None},
    ],
]


@pytest.fixture(scope="module")
def ours(default_gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GgufFile(default_gguf_path).metadata)


@pytest.fixture(scope="module")
def hf(default_gguf_path: str) -> Any:
    transformers = pytest.importorskip("transformers")
    path = Path(default_gguf_path)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decode_match_transformers(ours: Tokenizer, hf: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        )
    assert ours.decode(ids) == text


def test_special_ids(ours: Tokenizer, hf: Any) -> None:
    assert ours.bos_id == hf.bos_token_id == 1
    assert hf.eos_token_id in ours.eos_ids
    assert ours.eos_ids == {ours.backend.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert ours.vocab_size == len(hf) == 49152
    assert ours.token_to_str(ours.encode(" Paris")[0]) == " Paris"
    assert ours.token_to_str(2) == "<|im_end|>"
    pieces = b"".join(ours.token_bytes(i) for i in ours.encode("😀 日本"))
    assert pieces.decode() == "😀 日本"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, hf: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    expected = hf.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert (
        ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        == expected
    )


# Exercises what real templates use: tools and tojson, loop controls, the generation tag,
# namespace, bos/eos variables, extra kwargs.
CUSTOM_TEMPLATE = """{{ bos_token }}
{%- if tools %}Tools: {{ tools | tojson }}
{% endif %}
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
  {%- if m.role == 'forbidden' %}{{ raise_exception('role not allowed') }}{% endif %}
  {%- set ns.n = ns.n + 1 %}
  {%- if loop.index > 3 %}{% break %}{% endif %}
  {%- generation %}[{{ m.role }}] {{ m.content | trim }}{% endgeneration %}
{{ eos_token }}
{% endfor %}
{%- if add_generation_prompt %}[assistant]
  {%- if enable_thinking is defined %} think={{ enable_thinking }}{% endif %}
{%- endif %}
{{ ns.n }}"""


def test_custom_template_features(ours: Tokenizer, hf: Any) -> None:
    custom = Tokenizer(ours.backend, special=ours.special, chat_template=CUSTOM_TEMPLATE)
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"城市": "str"}}}
    ]
    conv = [*CONVERSATIONS[2], {"role": "user", "content": " fifth "}]
    for kwargs in ({}, {"enable_thinking": False}):
        got = custom.apply_chat_template(conv, tools=tools, **kwargs)
        expected = hf.apply_chat_template(
            conv,
            tools=tools,
            chat_template=CUSTOM_TEMPLATE,
            tokenize=False,
            add_generation_prompt=True,
            **kwargs,
        )
        assert got == expected
    with pytest.raises(ValueError, match="role not allowed"):
        custom.apply_chat_template([{"role": "forbidden", "content": "x"}])


def test_no_chat_template_is_a_clear_error(ours: Tokenizer) -> None:
    bare = Tokenizer(ours.backend, special=ours.special, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


STREAM_TEXTS = [
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 done",
    "中文和日本語が混ざった文章です。한국어도 있어요.",
    "plain words with spaces, then 🚀 at the end 🎉",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_detokenizer_streams_whole_characters(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == ours.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # some character really was split across tokens


def test_detokenizer_with_prompt_context_and_special_tokens(ours: Tokenizer) -> None:
    prompt = ours.encode("<|im_start|>assistant\n")
    answer = ours.encode("Bonjour ! 😀<|im_end|>")
    detok = IncrementalDetokenizer(ours, prompt_ids=prompt)
    streamed = "".join(detok.push(i) for i in answer) + detok.flush()
    assert streamed == ours.decode(answer, skip_special_tokens=True) == "Bonjour ! 😀"
    keep = IncrementalDetokenizer(ours, prompt_ids=prompt, skip_special_tokens=False)
    assert "".join(keep.push(i) for i in answer) + keep.flush() == "Bonjour ! 😀<|im_end|>"


def test_detokenizer_flushes_an_incomplete_character(ours: Tokenizer) -> None:
    ids = ours.encode("😀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(ours)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush() == ours.decode(ids[:-1])  # U+FFFD where the bytes stop


def test_sentencepiece_vocab_matches_transformers() -> None:
    """A llama-type (SentencePiece) GGUF vocabulary, built by us and by transformers."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "t",
        "a",
        "c",
        "s",
        "▁h",
        "he",
        "ll",
        "lo",
        "▁he",
        "llo",
        "▁hello",
        "or",
        "▁w",
        "▁wor",
        "ld",
        "▁world",
        "at",
        "▁c",
        "▁cat",
        "s",
    ]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *dict.fromkeys(pieces)]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(tokens) - 259)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    ours = Tokenizer.from_gguf_metadata(md)
    theirs, _ = mapping.convert_gguf_tokenizer(
        "llama",
        {"tokenizer_type": "llama", "tokens": tokens, "scores": scores, "token_type": types},
    )
    for text in ["hello world", " hello  cats", "world hello</s>", "héllo wörld ☃", "", "tl;dr"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.encode("hello")[0] == 1  # llama vocabularies add BOS by default
    assert ours.eos_ids == {2}
    assert ours.token_to_str(ours.encode("hello world", add_special_tokens=False)[-1]) == " world"


def test_a_limit_refuses_a_longer_text_and_keeps_a_shorter_one_whole(ours: Tokenizer) -> None:
    text = "Once upon a time a fox and a crow shared one small pool. " * 20
    ids = ours.encode(text)
    assert ours.encode(text, limit=len(ids)) == ids
    with pytest.raises(PromptTooLong) as refused:
        ours.encode(text, limit=len(ids) - 1)
    assert (refused.value.tokens, refused.value.limit) == (len(ids), len(ids) - 1)


def test_a_text_far_over_the_limit_is_refused_on_its_head(ours: Tokenizer) -> None:
    """Counted on its first part only, which already holds more tokens than the limit; a text
    just over the limit is counted whole."""
    sentence = "Once upon a time a fox and a crow shared one small pool. "
    with pytest.raises(PromptTooLong) as refused:
        ours.encode(sentence * 20_000, limit=1000)
    head = refused.value.counted_chars
    assert head is not None and head < len(sentence) * 20_000
    assert refused.value.tokens == len(ours.encode((sentence * 20_000)[:head])) > 1000
    whole = sentence * 1_000  # under the head's 65536 characters: counted whole
    with pytest.raises(PromptTooLong) as refused:
        ours.encode(whole, limit=1000)
    assert (refused.value.counted_chars, refused.value.tokens) == (None, len(ours.encode(whole)))
