"""Text <-> token ids (the ``tokenizers`` package) and chat templates (jinja2, rendered as HF does).

A tokenizer comes from a ``tokenizer.json`` (``from_file``) or from a GGUF's vocabulary
(``from_gguf_metadata``, built in gguf_vocab.py). Control tokens become special tokens, so
``<|im_end|>`` in a text encodes as one token, as with Hugging Face's tokenizers.
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
from tokenizers import Tokenizer as Backend
from tokenizers import decoders

from kvpark.tokenizer.gguf_vocab import END_OF_TURN as END_OF_TURN
from kvpark.tokenizer.gguf_vocab import TokenizerError as TokenizerError
from kvpark.tokenizer.gguf_vocab import gguf_vocab


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


class PromptTooLong(ValueError):
    """A text that encodes to more than the caller's limit of tokens: ``tokens`` of them in its
    first ``counted_chars`` characters, or in the whole text when that is None."""

    def __init__(self, tokens: int, limit: int, counted_chars: int | None = None) -> None:
        where = "" if counted_chars is None else f" in its first {counted_chars} characters"
        super().__init__(f"{tokens} tokens{where}, over the limit of {limit}")
        self.tokens = tokens
        self.limit = limit
        self.counted_chars = counted_chars


# A text over this many characters per token of the limit is first counted on its head alone:
# English runs ~4 characters a token, Chinese ~1.5, dense code ~8, so the head is well over
# any limit such a text exceeds.
PROBE_CHARS_PER_TOKEN = 16
PROBE_MIN_CHARS = 65536
# The head ends at a space, so its last word is whole; a margin still allows for the edge
PROBE_MARGIN_TOKENS = 8


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
        self.added_ids = frozenset(added)  # special or not: <|im_end|>, Gemma's "\n\n"
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._added = {i: t.content for i, t in added.items()}

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(
        self, text: str, add_special_tokens: bool = True, limit: int | None = None
    ) -> list[int]:
        """Special tokens written in the text (``<|im_start|>``) encode as themselves.

        add_special_tokens adds what the model adds to a prompt (its BOS), but no second BOS to a
        text that starts with one: a rendered chat template (Gemma's, Llama's write ``<bos>``)
        sent as a completion prompt. llama.cpp drops a template's leading BOS for this reason;
        two in a row are a prompt the model never saw in training.

        Encoded through ``encode_batch``, which releases the GIL (``encode`` holds it, ~1 s per
        MiB of text): a long prompt tokenized on a worker thread leaves the streams running.
        Past ``limit`` tokens it raises :class:`PromptTooLong`, and a text far longer than the
        limit is counted on its head only (:meth:`_refuse_by_head`): tokenizers' result holds
        every token's string, and freeing it holds the GIL (~0.4 s for 2 million tokens, an
        8 MiB prompt), as turning its ids into a Python list does (~50 ms)."""
        if limit is not None:
            self._refuse_by_head(text, add_special_tokens, limit)
        enc = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and len(enc) > limit:
            raise PromptTooLong(len(enc), limit)
        ids = list(enc.ids)
        mask = enc.special_tokens_mask  # 1 for what the post-processor added, 0 for the text's
        if len(ids) > 1 and ids[0] == ids[1] == self.bos_id and mask[0] and not mask[1]:
            del ids[0]
        return ids

    def _refuse_by_head(self, text: str, add_special_tokens: bool, limit: int) -> None:
        """Raise :class:`PromptTooLong` when the head of a text far longer than ``limit`` tokens
        already holds more. Normalizers and pre-tokenizers act locally, so the head, cut at a
        space, encodes as the text's first part does: no more tokens than the whole has."""
        probe = max(PROBE_MIN_CHARS, PROBE_CHARS_PER_TOKEN * limit)
        if len(text) <= probe:
            return
        space = text.rfind(" ", probe // 2, probe)
        head = text[: space if space > 0 else probe]
        tokens = len(self.backend.encode_batch([head], add_special_tokens=add_special_tokens)[0])
        if tokens > limit + PROBE_MARGIN_TOKENS:
            raise PromptTooLong(tokens, limit, len(head))

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
        """From a GGUF's metadata (gguf_vocab.py); TokenizerError if kvpark cannot build it."""
        v = gguf_vocab(md)
        return cls(
            v.backend,
            special=v.special,
            extra_eos_ids=v.extra_eos_ids,
            chat_template=v.chat_template,
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
