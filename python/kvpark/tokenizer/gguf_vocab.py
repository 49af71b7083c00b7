"""A ``tokenizers`` backend from a GGUF's vocabulary (its ``tokenizer.ggml.*`` metadata).

Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) with the pre-tokenizer regex llama.cpp uses for
the file's ``pre`` type, or SentencePiece-style BPE (``"llama"``, sentencepiece.py). Token types say
what else a token is: control tokens (and <unk>) become special tokens (``<|im_end|>`` in a text
encodes as one token; a decode that skips special tokens drops it), user-defined ones plain added
tokens, matched whole before BPE sees the text (Gemma's ``\\n\\n`` and its runs of spaces, which
its GGUFs spell with real spaces).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from kvpark.tokenizer.sentencepiece import eats_space_after, is_phi3, sentencepiece_bpe

# Tokens that end a turn in some model family; llama.cpp treats them as end-of-generation too.
_EOT = "<|im_end|> <|eot_id|> <|eom_id|> <|endoftext|> <|end|> <end_of_turn> <|end_of_text|>"
END_OF_TURN = (*_EOT.split(), "<｜end▁of▁sentence｜>")

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one at a time
# tokenizer.ggml.pre -> the splits llama.cpp applies, in order, before byte-level BPE.
_PRE_SPLITS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (_QWEN2_SPLIT,)),
    **dict.fromkeys(("smollm", "starcoder", "refact"), (r"\p{N}", _GPT2_SPLIT)),
}
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # llama.cpp token types


class TokenizerError(ValueError):
    """A tokenizer description (GGUF metadata, tokenizer.json) that kvpark cannot build."""


@dataclass(frozen=True)
class GgufVocab:
    backend: Backend
    special: dict[str, str | None]  # bos_token, eos_token, unk_token, pad_token
    extra_eos_ids: list[int]
    chat_template: str | None


def gguf_vocab(md: Mapping[str, Any]) -> GgufVocab:
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
    types: list[int] = md.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if not tokens:
        raise TokenizerError("the GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    scores = md.get("tokenizer.ggml.scores") or []
    if len(types) != len(tokens) or len(scores) not in (0, len(tokens)):
        raise TokenizerError("the GGUF's token types or scores do not match its vocabulary")
    # A turn's end typed as a plain or user-defined token (some Phi-3 files type <|end|> so) is
    # still one: llama.cpp makes it a control token, so it ends generation and a decode that
    # skips special tokens drops it.
    types = [
        _CONTROL if t in END_OF_TURN and ty in (_NORMAL, _USER_DEFINED) else ty
        for t, ty in zip(tokens, types, strict=True)
    ]
    phi3 = is_phi3(md.get("general.architecture"), kind)
    if kind == "gpt2":
        backend = _byte_level_bpe(
            tokens, md.get("tokenizer.ggml.merges") or [], md.get("tokenizer.ggml.pre", "default")
        )
    elif kind == "llama":
        backend = sentencepiece_bpe(
            tokens,
            scores,
            types,
            add_space_prefix=md.get("tokenizer.ggml.add_space_prefix", True),
            phi3=phi3,
        )
    else:
        raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama)")
    # <unk> written in a text is the unknown token, as in llama.cpp and Llama's tokenizer.json.
    for wanted, is_special in (((_CONTROL, _UNKNOWN), True), ((_USER_DEFINED,), False)):
        added = [
            AddedToken(t, special=is_special, normalized=False, rstrip=eats_space_after(t, phi3))
            for t, ty in zip(tokens, types, strict=True)
            if ty in wanted
        ]
        if is_special:
            backend.add_special_tokens(added)
        else:
            backend.add_tokens(added)

    def token(key: str) -> str | None:
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    special = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
    }
    add_bos = md.get("tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and special["bos_token"] is not None:
        bos = special["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))],
        )
    extra = [
        md[k]
        for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if isinstance(md.get(k), int)
    ]
    return GgufVocab(backend, special, extra, md.get("tokenizer.chat_template"))


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> Backend:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    splits = _PRE_SPLITS.get(pre, (_GPT2_SPLIT,))  # gpt2, default
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend
