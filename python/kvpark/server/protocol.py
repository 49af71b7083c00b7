"""OpenAI request bodies -> prompt token ids and :class:`SamplingParams`.

Parsing checks types (a wrong type is a 400 naming the field), turns the prompt forms into token-id
lists and leaves ranges to :meth:`SamplingParams.validate`, so the limits live in one place.
Everything the engine must judge (token ids inside the vocabulary, prompt plus ``max_tokens`` inside
the context) is left to ``engine.check_request``. ``null`` means "not given" for every optional
field, as in the OpenAI API.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from kvpark.sampling.params import InvalidParameterError, SamplingParams
from kvpark.server.body import Fields
from kvpark.server.errors import bad_request

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
MAX_PROMPTS = 64
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
Kind = Literal["chat", "completion"]


class TokenizerLike(Protocol):
    """What the server needs of ``kvpark.tokenizer.tokenizer.Tokenizer``."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = ...) -> str: ...

    def token_to_str(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = ...,
        tools: list[dict[str, Any]] | None = ...,
    ) -> str: ...


@dataclass(frozen=True)
class GenerationRequest:
    """One parsed request: prompts (one engine request each), each with its own params."""

    kind: Kind
    prompts: list[list[int]]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool

    @property
    def n(self) -> int:
        return self.params[0].n


def parse_chat(
    body: dict[str, object], tokenizer: TokenizerLike, max_model_len: int
) -> GenerationRequest:
    fields = Fields(body)
    messages = _messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise bad_request("tools must be a list of objects", "tools")
    top_logprobs = fields.integer("top_logprobs")
    logprobs: int | None = None
    if fields.boolean("logprobs", False):
        logprobs = 0 if top_logprobs is None else top_logprobs
    elif top_logprobs is not None:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    _refuse_unsupported(fields)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except Exception as exc:  # the template's raise_exception: alternating roles and the like
        raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
    prompt = tokenizer.encode(text, add_special_tokens=False)
    return _request("chat", fields, [prompt], logprobs, None, tokenizer.vocab_size, max_model_len)


def parse_completion(
    body: dict[str, object], tokenizer: TokenizerLike, max_model_len: int
) -> GenerationRequest:
    fields = Fields(body)
    if fields.boolean("echo", False):
        raise bad_request("echo is not supported", "echo")
    if fields.has("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    _refuse_unsupported(fields)
    prompts = _prompts(body.get("prompt"), tokenizer)
    logprobs = fields.integer("logprobs")
    return _request(
        "completion",
        fields,
        prompts,
        logprobs,
        COMPLETION_DEFAULT_MAX_TOKENS,
        tokenizer.vocab_size,
        max_model_len,
    )


def _request(
    kind: Kind,
    fields: Fields,
    prompts: list[list[int]],
    logprobs: int | None,
    default_max_tokens: int | None,
    vocab_size: int,
    max_model_len: int,
) -> GenerationRequest:
    max_tokens = fields.integer("max_completion_tokens")
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens")
    stream = fields.boolean("stream", False)
    include_usage = Fields(fields.object("stream_options")).boolean("include_usage", False)
    stop_token_ids = fields.body.get("stop_token_ids")
    if stop_token_ids is not None and not (
        isinstance(stop_token_ids, list)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids)
    ):
        raise bad_request("stop_token_ids must be a list of integers", "stop_token_ids")
    n = fields.integer("n")
    base = SamplingParams(
        max_tokens=1 if max_tokens is None else max_tokens,
        temperature=fields.number("temperature", 1.0),
        top_p=fields.number("top_p", 1.0),
        top_k=_or(fields.integer("top_k"), 0),
        min_p=fields.number("min_p", 0.0),
        presence_penalty=fields.number("presence_penalty", 0.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0),
        seed=fields.integer("seed"),
        stop=fields.strings("stop"),
        stop_token_ids=tuple(stop_token_ids or ()),
        ignore_eos=fields.boolean("ignore_eos", False),
        logprobs=logprobs,
        n=_or(n, 1),
    )
    try:
        base.validate(vocab_size)
    except InvalidParameterError as exc:
        param = "logprobs" if kind == "completion" and exc.param == "top_logprobs" else exc.param
        message = str(exc).replace("top_logprobs", param)
        raise bad_request(message, param) from None
    params = []
    for prompt in prompts:
        limit = max_tokens if max_tokens is not None else default_max_tokens
        if limit is None:  # chat without a limit: the rest of the context
            limit = max(1, max_model_len - len(prompt))
        params.append(replace(base, max_tokens=limit))
    return GenerationRequest(kind, prompts, params, stream, include_usage and stream)


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _refuse_unsupported(fields: Fields) -> None:
    """Fields we would otherwise silently ignore although they change the output."""
    if fields.object("logit_bias"):
        raise bad_request("logit_bias is not supported", "logit_bias")
    best_of = fields.integer("best_of")
    if best_of is not None and best_of not in (1, _or(fields.integer("n"), 1)):
        raise bad_request("best_of is not supported", "best_of")
    response_format = Fields(fields.object("response_format")).string("type")
    if response_format not in (None, "text"):
        raise bad_request(
            f"response_format {response_format!r} is not supported", "response_format"
        )


def _messages(value: object) -> list[dict[str, object]]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}", "messages")
        messages.append({**message, "content": _content(message.get("content"), i)})
    return messages


def _content(content: object, i: int) -> str:
    """A message's content as text: a string, ``null`` or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise bad_request(
                    f"messages[{i}]: only text content parts are supported", "messages"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"messages[{i}]: a text part needs a string 'text'", "messages")
            texts.append(text)
        return "".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of parts", "messages")


def _prompts(value: object, tokenizer: TokenizerLike) -> list[list[int]]:
    """string | [string, ...] | [id, ...] | [[id, ...], ...] -> one token-id list per prompt."""
    if isinstance(value, str):
        prompts = [tokenizer.encode(value, add_special_tokens=True)]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = [tokenizer.encode(p, add_special_tokens=True) for p in value]
    elif isinstance(value, list) and value and all(_is_ids(p) for p in value):
        prompts = [list(value)]
    elif isinstance(value, list) and value and all(isinstance(p, list) for p in value):
        if not all(_is_ids(t) for p in value for t in p):
            raise bad_request("prompt token ids must be integers", "prompt")
        prompts = [list(p) for p in value]
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of token-id lists",
            "prompt",
        )
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    if any(not p for p in prompts):
        raise bad_request("a prompt is empty", "prompt")
    return prompts


def _is_ids(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
