"""A SentencePiece-style vocabulary (a GGUF's ``tokenizer.ggml.model == "llama"``) as a
``tokenizers`` BPE, with the spacing of the model family it belongs to.

A GGUF keeps SentencePiece's pieces and scores but no merges. SentencePiece's BPE merges, at each
step, the adjacent pair that makes the highest-scoring piece, so a merge's rank is the score of the
piece it makes. Characters outside the vocabulary fall back to byte tokens ``<0x00>``..``<0xFF>``.

Where a ▁ (SentencePiece's space) goes is not the same in every family, and nothing in the file but
``add_space_prefix`` and the architecture says which:

- ``add_space_prefix`` false (Gemma): each space becomes ▁ and nothing is prepended, so a prompt
  that begins with ``Hello`` starts with the piece ``Hello``, not ``▁Hello``.
- true (Llama 2, Mistral): one ▁ before the text, none after a special token inside it, as
  transformers' Llama tokenizer does (``legacy=False``).
- Phi-3: its own tokenizer.json prepends ▁ to every stretch of text between added tokens, and its
  added tokens eat the whitespace after them, all but ``<unk>``, ``<s>`` and ``<|endoftext|>``. Its
  template writes ``<|user|>\\nHi<|end|>\\n``, which the model saw as ``<|user|> ▁Hi <|end|>``;
  llama.cpp tokenizes Phi-3 files this way too.
"""

from __future__ import annotations

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers

SPACE = "▁"
_UNKNOWN = 2  # llama.cpp's token type of <unk>
# Phi-3's added tokens that keep the whitespace after them (every other one strips it).
_PHI3_KEEP_SPACE = frozenset(("<unk>", "<s>", "<|endoftext|>"))


def is_phi3(architecture: object, kind: object) -> bool:
    """Phi-3's SentencePiece vocabulary (Phi-4-mini is a phi3 architecture too, with byte-level
    BPE and none of this)."""
    return architecture == "phi3" and kind == "llama"


def eats_space_after(token: str, phi3: bool) -> bool:
    """Whether an added (control or user-defined) token swallows the whitespace that follows it."""
    return phi3 and token not in _PHI3_KEEP_SPACE


def sentencepiece_bpe(
    tokens: list[str],
    scores: list[float],
    types: list[int],
    *,
    add_space_prefix: bool,
    phi3: bool = False,
) -> Backend:
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = next((t for t, ty in zip(tokens, types, strict=True) if ty == _UNKNOWN), None)
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=_merges(tokens, scores, vocab),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    if phi3 and add_space_prefix:
        # A normalizer runs on each stretch of text between added tokens, so every one gets its ▁.
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
    else:
        scheme = "first" if add_space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme=scheme, split=False
        )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the ▁ the encoder put before the text is not part of it
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, ranked by the score of the piece
    it makes; among splits of one piece the longer left part first."""
    score = dict(zip(tokens, scores or [0.0] * len(tokens), strict=True))
    merges: list[tuple[str, str, float]] = []
    for t in tokens:
        local = [(t[:i], t[i:]) for i in range(1, len(t)) if t[:i] in vocab and t[i:] in vocab]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((a, b, score[t]) for a, b in local)
    merges.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))
    return [(a, b) for a, b, _ in merges]
