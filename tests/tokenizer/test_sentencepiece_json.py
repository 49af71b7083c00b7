"""A Gemma or Phi-3 Hugging Face directory's tokenizer.json (SentencePiece BPE with byte fallback,
and a Unigram model), read by the HF loader with tokenizer_config.json's chat template: it renders
and encodes the chat as the GGUF of the same vocabulary does, with one BOS and the turn's end as
an end of generation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spm_families import (
    CHAT,
    CONTROL,
    GEMMA_CHAT,
    GEMMA_TEMPLATE,
    PHI3_ADDED,
    PHI3_CHAT,
    PHI3_TEMPLATE,
    PHI3_TEXTS,
    USER_DEFINED,
    gemma_metadata,
    learned,
    phi3_metadata,
)
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from kvpark.model.hf_loader import tokenizer_from_dir
from kvpark.tokenizer.tokenizer import Tokenizer


def _json_dir(root: Path, backend: Backend, config: dict[str, Any], eos: list[int]) -> Path:
    root.mkdir()
    backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return root


def _bpe(md: dict[str, Any], merges: list[tuple[str, str]]) -> Backend:
    """The vocabulary of ``md`` with the trainer's own merges, as a BPE with byte fallback."""
    vocab = {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
    return Backend(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))


def _add(backend: Backend, special: list[str], plain: list[str]) -> None:
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    backend.add_tokens([AddedToken(t, normalized=False) for t in plain])


def test_gemma_tokenizer_json(tmp_path: Path) -> None:
    """Gemma's tokenizer.json: spaces to ▁ by a normalizer, no prefix, <bos> from the
    post-processor."""
    md = gemma_metadata()
    backend = _bpe(md, learned("never")[1])
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    _add(backend, specials, ["\n", "\n\n", "<table>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)]
    )
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": GEMMA_TEMPLATE}
    tok = tokenizer_from_dir(_json_dir(tmp_path / "gemma", backend, config, [1, 5]), {})
    assert tok.apply_chat_template(CHAT) == GEMMA_CHAT
    ids = tok.encode(GEMMA_CHAT)
    gguf = Tokenizer.from_gguf_metadata(md)
    assert ids == gguf.encode(GEMMA_CHAT)  # what the GGUF of the same vocabulary gives
    assert ids.count(2) == 1 and tok.encode("Hello")[0] == 2
    assert tok.eos_ids == {1, 5}
    assert tok.decode(ids) == GEMMA_CHAT


def test_phi3_tokenizer_json(tmp_path: Path) -> None:
    """Phi-3's tokenizer.json: a ▁ prepended by a normalizer (so to each stretch between added
    tokens), and added tokens that strip the whitespace after them."""
    md = phi3_metadata()
    backend = _bpe(md, learned("always")[1])
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    keep = ("<unk>", "<s>", "<|endoftext|>")
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True, rstrip=t not in keep)
            for t in ["<unk>", "<s>", "</s>", *PHI3_ADDED]
        ]
    )
    config = {"bos_token": "<s>", "eos_token": "<|endoftext|>", "chat_template": PHI3_TEMPLATE}
    end = md["tokenizer.ggml.tokens"].index("<|end|>")
    tok = tokenizer_from_dir(_json_dir(tmp_path / "phi3", backend, config, [end]), {})
    assert tok.apply_chat_template(CHAT) == PHI3_CHAT
    for added_type in (CONTROL, USER_DEFINED):
        gguf = Tokenizer.from_gguf_metadata(phi3_metadata(added_type))
        for text in PHI3_TEXTS:
            assert tok.encode(text) == gguf.encode(text), text
    assert end in tok.eos_ids and md["tokenizer.ggml.eos_token_id"] in tok.eos_ids


def test_unigram_tokenizer_json(tmp_path: Path) -> None:
    """A Unigram SentencePiece model (Metaspace, byte fallback) with Gemma's chat tokens."""
    md = gemma_metadata()
    tokens, scores = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"]
    backend = Backend(models.Unigram(list(zip(tokens, scores, strict=True)), 3, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    _add(backend, specials, ["\n", "\n\n"])
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)]
    )
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": GEMMA_TEMPLATE}
    tok = tokenizer_from_dir(_json_dir(tmp_path / "unigram", backend, config, [1]), {})
    ids = tok.encode(tok.apply_chat_template(CHAT))
    assert ids.count(2) == 1 and ids.count(4) == 4 and ids.count(5) == 3
    assert tok.decode(ids) == GEMMA_CHAT
    assert tok.eos_ids == {1, 5}  # <end_of_turn> is special in the file
    emoji = tok.encode("😀", add_special_tokens=False)
    assert [tok.backend.id_to_token(i) for i in emoji] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert b"".join(tok.token_bytes(i) for i in emoji) == "😀".encode()
    world = tok.encode("Hello world", add_special_tokens=False)
    assert "".join(tok.token_to_str(i) for i in world) == "Hello world"
