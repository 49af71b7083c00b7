"""Text <-> token ids (the ``tokenizers`` package) and chat templates (jinja2, rendered as HF does).

A tokenizer comes from a ``tokenizer.json`` (``from_file``) or from a GGUF's vocabulary
(``from_gguf_metadata``): byte-level BPE (``tokenizer.ggml.model == "gpt2"``) with the pre-tokenizer
regex llama.cpp uses for the file's ``pre`` type, or a SentencePiece-style BPE (``"llama"``) with
merges recovered from the scores. Control tokens become special tokens, so ``<|im_end|>`` in a text
encodes as one token, as with Hugging Face's tokenizers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

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
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map past U+0100."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


class TokenizerError(ValueError):
    """A tokenizer description (GGUF metadata, tokenizer.json) that kvpark cannot build."""


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        *,
        special: Mapping[str, str | None],
        extra_eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        """special: bos_token / eos_token / unk_token / pad_token strings (None when absent);
        extra_eos_ids: more end-of-generation ids, e.g. from generation_config.json."""
        self.backend = backend
        self.special = {k: v for k, v in special.items() if v is not None}
        self.chat_template = chat_template
        self.bos_id = self._id_of(self.special.get("bos_token"))
        added = backend.get_added_tokens_decoder()
        eos = {self._id_of(self.special.get("eos_token")), *extra_eos_ids}
        eos.update(i for i, t in added.items() if t.special and t.content in END_OF_TURN)
        self.eos_ids: frozenset[int] = frozenset(i for i in eos if i is not None)
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._added = {i: t.content for i, t in added.items()}

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in the text (``<|im_start|>``) encode as themselves."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_str(self, token_id: int) -> str:
        """The token's text as it appears in decoded output, leading space included."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (part of a UTF-8 character for some byte-level tokens)."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} outside the vocabulary ({self.vocab_size})")
        if self._byte_level:
            return bytes(_BYTE_OF_CHAR.get(c, 0x3F) for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        return piece.replace("▁", " ").encode()

    # ---- chat templates ----

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a completion prompt instead")
        return compile_chat_template(self.chat_template)

    def set_chat_template(self, source: str) -> None:
        """Replace the model's chat template (``--chat-template``); ValueError if it does not
        compile."""
        template = compile_chat_template(source)
        self.chat_template = source
        self.__dict__["_template"] = template  # the cached_property's slot

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, rendered as transformers' apply_chat_template does.

        A template that rejects the conversation (``raise_exception``) raises ValueError."""
        # Like transformers: keys set to None are dropped (templates test presence, not None).
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special, "documents": None, **kwargs, "messages": messages}
        variables.update(tools=tools, add_generation_prompt=add_generation_prompt)
        try:
            return str(self._template.render(**variables))
        except jinja2.TemplateError as e:  # raise_exception() in the template, or a template bug
            raise ValueError(f"chat template: {e}") from e

    @classmethod
    def from_file(cls, path: str, **kwargs: Any) -> Tokenizer:
        """From a tokenizer.json; kwargs as for the constructor."""
        return cls(Backend.from_file(path), **kwargs)

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        kind = md.get("tokenizer.ggml.model")
        tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
        types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if not tokens:
            raise TokenizerError("the GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        scores = md.get("tokenizer.ggml.scores") or []
        if len(types) != len(tokens) or len(scores) not in (0, len(tokens)):
            raise TokenizerError("the GGUF's token types or scores do not match its vocabulary")
        if kind == "gpt2":
            backend = _byte_level_bpe(
                tokens,
                md.get("tokenizer.ggml.merges") or [],
                md.get("tokenizer.ggml.pre", "default"),
            )
        elif kind == "llama":
            backend = _sentencepiece_bpe(
                tokens,
                scores,
                types,
                md.get("tokenizer.ggml.add_space_prefix", True),
            )
        else:
            raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama)")
        specials = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL
        ]
        backend.add_special_tokens(specials)
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _USER_DEFINED
            ]
        )

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
        return cls(
            backend,
            special=special,
            extra_eos_ids=extra,
            chat_template=md.get("tokenizer.chat_template"),
        )


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled as transformers does (sandboxed, trim_blocks, lstrip_blocks);
    ValueError naming the line of a syntax error."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not compile: line {exc.lineno}: {exc}") from exc


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


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool
) -> Backend:
    """SentencePiece BPE as a tokenizers BPE: a merge's rank is the score of the token it makes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores or [0.0] * len(tokens), strict=True))
    merges: list[tuple[str, str, float]] = []
    for t in tokens:
        local = [(t[:i], t[i:]) for i in range(1, len(t)) if t[:i] in vocab and t[i:] in vocab]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((a, b, score[t]) for a, b in local)
    merges.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))
    unk = next((t for t, ty in zip(tokens, types, strict=True) if ty == 2), None)
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for a, b, _ in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    scheme = "first" if add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): the
    body renders unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads this class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())
