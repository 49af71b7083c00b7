"""Gemma's and Phi-3's SentencePiece vocabularies from GGUF metadata, as llama.cpp's converter
writes them, through their real chat templates: the ids llama.cpp would give (spm_reference) and,
for Gemma, transformers' GGUF tokenizer; control tokens one id each, one BOS, the turn's end ends
generation, byte fallback, SentencePiece's spaces, the streamed answer.
"""

from __future__ import annotations

from typing import Any

import pytest
from spm_families import (
    CHAT,
    CONTROL,
    GEMMA_CHAT,
    PHI3_CHAT,
    PHI3_TEMPLATE,
    PHI3_TEXTS,
    TEXTS,
    USER_DEFINED,
    gemma_metadata,
    phi3_metadata,
    spm_reference,
    token_id,
)

from kvpark.tokenizer.detokenizer import IncrementalDetokenizer
from kvpark.tokenizer.tokenizer import Tokenizer

# ---- Gemma, from GGUF ----


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gemma_metadata())


def test_gemma_template_renders_turns_as_gemma_writes_them(gemma: Tokenizer) -> None:
    assert gemma.apply_chat_template(CHAT) == GEMMA_CHAT
    hi = [{"role": "user", "content": " hi "}]
    assert gemma.apply_chat_template(hi, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n"
    )
    with pytest.raises(ValueError, match="must alternate"):
        gemma.apply_chat_template([*hi, *hi])


@pytest.mark.parametrize("text", [*TEXTS, GEMMA_CHAT])
def test_gemma_gguf_tokenizes_as_llama_cpp(gemma: Tokenizer, text: str) -> None:
    ids = gemma.encode(text, add_special_tokens=False)
    assert ids == spm_reference(gemma_metadata(), text, phi3=False)
    assert gemma.decode(ids) == text


def test_gemma_gguf_matches_transformers(gemma: Tokenizer) -> None:
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    md = gemma_metadata()
    fields = {"tokens": "tokens", "scores": "scores", "token_type": "token_type"}
    theirs, _ = mapping.convert_gguf_tokenizer(
        "gemma3",
        {"tokenizer_type": "llama", **{v: md[f"tokenizer.ggml.{k}"] for k, v in fields.items()}},
    )
    # Not runs of 4+ spaces: there transformers merges its respelled "▁▁" tokens pairwise, where
    # SentencePiece and llama.cpp take the longest user-defined run ("   ") first.
    texts = ["", "Hello world", " Hello  world", "Hello   world", "a\n\nb\n\n\nc\n"]
    for text in [*texts, "I like cats 😀 and café ☃", GEMMA_CHAT]:
        ids = gemma.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert gemma.decode(ids) == theirs.decode(ids, skip_special_tokens=False)


def test_gemma_chat_ids(gemma: Tokenizer) -> None:
    bos, sot, eot = (token_id(gemma, t) for t in ("<bos>", "<start_of_turn>", "<end_of_turn>"))
    ids = gemma.encode(GEMMA_CHAT)
    # The template writes <bos>; the vocabulary's add_bos_token adds none on top of it.
    assert ids == gemma.encode(GEMMA_CHAT, add_special_tokens=False)
    assert ids[0] == bos and ids.count(bos) == 1
    assert gemma.encode("Hello world") == [bos, *gemma.encode("Hello world", False)]
    assert (ids.count(sot), ids.count(eot)) == (4, 3)  # control tokens are one id each
    assert ids[-3:] == [sot, token_id(gemma, "model"), token_id(gemma, "\n")]
    assert gemma.decode(ids) == GEMMA_CHAT
    plain = GEMMA_CHAT
    for t in ("<bos>", "<start_of_turn>", "<end_of_turn>"):
        plain = plain.replace(t, "")
    assert gemma.decode(ids, skip_special_tokens=True) == plain


@pytest.mark.parametrize("eot_type", [CONTROL, USER_DEFINED], ids=["control", "user-defined"])
def test_gemma_end_of_turn_ends_generation(eot_type: int) -> None:
    tok = Tokenizer.from_gguf_metadata(gemma_metadata(eot_type))
    eos, eot = token_id(tok, "<eos>"), token_id(tok, "<end_of_turn>")
    assert tok.eos_ids == {eos, eot}
    assert tok.bos_id == token_id(tok, "<bos>")
    assert tok.special == {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"} | {
        "pad_token": "<pad>"
    }
    answer = tok.encode("Paris.<end_of_turn>", add_special_tokens=False)
    assert answer[-1] == eot
    assert tok.decode(answer, skip_special_tokens=True) == "Paris."


def test_gemma_spaces_and_byte_fallback(gemma: Tokenizer) -> None:
    def pieces(text: str) -> list[str]:
        return [gemma.backend.id_to_token(i) for i in gemma.encode(text, False)]

    assert pieces("Hello world") == ["Hello", "▁world"]  # no ▁ before the text (no space prefix)
    assert pieces(" Hello") == ["▁", "Hello"]
    assert pieces("Hello  model") == ["Hello", "  ", "model"]  # the user-defined run of two
    assert gemma.token_to_str(gemma.encode("Hello world", False)[1]) == " world"
    text = "cats 😀?"
    ids = gemma.encode(text, add_special_tokens=False)
    assert pieces(text)[-5:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "?"]
    assert b"".join(gemma.token_bytes(i) for i in ids) == text.encode()
    detok = IncrementalDetokenizer(gemma, prompt_ids=gemma.encode("<start_of_turn>model\n"))
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) + detok.flush() == gemma.decode(ids) == text
    assert deltas[-5:] == ["", "", "", "😀", "?"]  # never half an emoji


# ---- Phi-3, from GGUF ----


@pytest.fixture(scope="module", params=[CONTROL, USER_DEFINED], ids=["control", "user-defined"])
def phi3_md(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Phi-3's chat tokens typed control or user-defined: its GGUFs have both."""
    return phi3_metadata(request.param)


@pytest.fixture(scope="module")
def phi3(phi3_md: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(phi3_md)


@pytest.mark.parametrize("text", PHI3_TEXTS)
def test_phi3_gguf_tokenizes_as_llama_cpp(
    phi3: Tokenizer, phi3_md: dict[str, Any], text: str
) -> None:
    assert phi3.encode(text, False) == spm_reference(phi3_md, text, phi3=True)


def test_phi3_chat(phi3: Tokenizer) -> None:
    assert phi3.apply_chat_template(CHAT) == PHI3_CHAT
    user, end, assistant = (token_id(phi3, t) for t in ("<|user|>", "<|end|>", "<|assistant|>"))
    # Each chat token is one id and takes the newline after it; the text after it gets its ▁.
    ids = phi3.encode("<|user|>\nHello world<|end|>\n<|assistant|>\n")
    assert ids == [user, token_id(phi3, "▁Hello"), token_id(phi3, "▁world"), end, assistant]
    assert phi3.encode(PHI3_CHAT) == phi3.encode(PHI3_CHAT, False)  # add_bos_token false
    # <|end|> ends generation whether the file types it control or user-defined, and is no text.
    assert phi3.eos_ids == {end, token_id(phi3, "<|endoftext|>")}
    answer = phi3.encode("The capital of France is Paris.<|end|>", False)
    detok = IncrementalDetokenizer(phi3, prompt_ids=ids)
    streamed = "".join(detok.push(i) for i in answer) + detok.flush()
    assert streamed == phi3.decode(answer, skip_special_tokens=True)
    assert streamed == "The capital of France is Paris."


def test_phi3_bos_once() -> None:
    tok = Tokenizer.from_gguf_metadata(phi3_metadata(add_bos=True))
    bos = token_id(tok, "<s>")
    ids = tok.encode(PHI3_CHAT)  # the template writes no <s>: add_bos_token adds it
    assert ids == [bos, *tok.encode(PHI3_CHAT, False)]
    tok.set_chat_template("{{ bos_token }}" + PHI3_TEMPLATE)  # Phi-3's first template wrote it
    written = tok.apply_chat_template(CHAT)
    assert written == "<s>" + PHI3_CHAT
    assert tok.encode(written) == ids
