"""OpenAI request bodies -> prompt token ids and :class:`SamplingParams`.

The bodies are the pydantic models of :mod:`kvpark.server.openai_bodies` (an unknown field or a
wrong type is a 400 naming it); this module turns them into a :class:`GenerationRequest`: the
prompt forms into token-id lists, the sampling fields into params whose ranges
:meth:`SamplingParams.validate` checks, so the limits live in one place. Everything the engine must
judge (token ids inside the vocabulary, prompt plus ``max_tokens`` inside the context) is left to
``engine.check_request``. The Responses and Anthropic routes translate their bodies into a chat
body and call :func:`parse_chat` too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from pydantic import ValidationError

from kvpark.sampling.params import Constraint, InvalidParameterError, SamplingParams
from kvpark.server.errors import bad_request
from kvpark.server.openai_bodies import (
    ChatCompletionBody,
    ChatMessage,
    CompletionBody,
    SamplingBody,
)
from kvpark.server.openai_constraints import body_constraint
from kvpark.server.openai_refusals import refuse_chat, refuse_completion
from kvpark.server.prompts import completion_prompts, encode_within
from kvpark.server.schema import Body, validation_error

if TYPE_CHECKING:
    from kvpark.server.tools import ToolPlan

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
Kind = Literal["chat", "completion"]
B = TypeVar("B", bound=Body)


class TokenizerLike(Protocol):
    """What the server needs of ``kvpark.tokenizer.tokenizer.Tokenizer``."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def chat_template(self) -> str | None: ...

    def encode(
        self, text: str, add_special_tokens: bool = ..., limit: int | None = ...
    ) -> list[int]: ...

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
    tools: ToolPlan | None = None  # chat with tools: how to render and parse the calls
    echo: list[str] | None = None  # completions with echo: each prompt's text, output first
    cache_salt: str | None = None  # the body's; the pipeline folds it into params.cache_salt

    @property
    def n(self) -> int:
        return self.params[0].n


def parse_chat(
    body: dict[str, object], tokenizer: TokenizerLike, max_model_len: int
) -> GenerationRequest:
    chat = parse_openai_body(ChatCompletionBody, body)
    refuse_chat(chat)
    if chat.top_logprobs is not None and not chat.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (0 if chat.top_logprobs is None else chat.top_logprobs) if chat.logprobs else None
    messages = [_message(m) for m in chat.messages]
    constraint = body_constraint(chat)
    plan = _tool_plan(chat, messages, tokenizer)
    template_tools = chat.tools
    if plan is not None:
        if constraint is not None and plan.constraint is not None:
            raise bad_request(
                f"tools constrain the output; {constraint.param} cannot as well", constraint.param
            )
        messages, template_tools = plan.messages, plan.template_tools
        constraint = constraint or plan.constraint
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=template_tools
        )
    except Exception as exc:  # the template's raise_exception: alternating roles and the like
        raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
    prompt = encode_within(tokenizer, text, False, max_model_len, "messages")
    max_tokens = chat.max_completion_tokens
    if max_tokens is None:
        max_tokens = chat.max_tokens
    request = _request(
        "chat", chat, [prompt], logprobs, max_tokens, None, constraint, tokenizer, max_model_len
    )
    return replace(request, tools=plan)


def parse_completion(
    body: dict[str, object], tokenizer: TokenizerLike, max_model_len: int
) -> GenerationRequest:
    completion = parse_openai_body(CompletionBody, body)
    refuse_completion(completion)
    prompts, texts = completion_prompts(
        completion.prompt, completion.suffix, tokenizer, max_model_len
    )
    request = _request(
        "completion",
        completion,
        prompts,
        completion.logprobs,
        completion.max_tokens,
        COMPLETION_DEFAULT_MAX_TOKENS,
        body_constraint(completion),
        tokenizer,
        max_model_len,
    )
    if not completion.echo:
        return request
    return replace(request, echo=texts or [_echo_text(p, tokenizer) for p in prompts])


def parse_openai_body(model: type[B], body: dict[str, object]) -> B:
    """``body`` as ``model``; a 400 whose ``param`` is the top-level field at fault (pydantic's
    location also names union members, ``stop.str``, which no client would recognise)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = validation_error(exc)
        loc = exc.errors()[0]["loc"]
        raise bad_request(error.message, str(loc[0]) if loc else None) from None


def _request(
    kind: Kind,
    body: SamplingBody,
    prompts: list[list[int]],
    logprobs: int | None,
    max_tokens: int | None,
    default_max_tokens: int | None,
    constraint: Constraint | None,
    tokenizer: TokenizerLike,
    max_model_len: int,
) -> GenerationRequest:
    stop = body.stop if body.stop is not None else ()
    base = SamplingParams(
        max_tokens=1,  # each prompt's limit is set below
        temperature=_or(body.temperature, 1.0),
        top_p=_or(body.top_p, 1.0),
        top_k=_or(body.top_k, 0),
        min_p=_or(body.min_p, 0.0),
        presence_penalty=_or(body.presence_penalty, 0.0),
        frequency_penalty=_or(body.frequency_penalty, 0.0),
        seed=body.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=_or(body.ignore_eos, False),
        logprobs=logprobs,
        n=_or(body.n, 1),
        logit_bias=_logit_bias(body.logit_bias),
        min_tokens=_or(body.min_tokens, 0),
        repetition_penalty=_or(body.repetition_penalty, 1.0),
        constraint=constraint,
    )
    params = []
    for prompt in prompts:
        limit = max_tokens if max_tokens is not None else default_max_tokens
        if limit is None:  # chat without a limit: the rest of the context
            limit = max(1, max_model_len - len(prompt))
        params.append(replace(base, max_tokens=limit))
    try:  # each prompt's own: limits such as min_tokens <= max_tokens need the final max_tokens
        for one in params:
            one.validate(tokenizer.vocab_size)
    except InvalidParameterError as exc:
        param = exc.param
        if param == "top_logprobs" and kind == "completion":
            param = "logprobs"
        elif param == "max_tokens" and kind == "chat" and body.max_tokens is None:
            param = "max_completion_tokens"
        raise bad_request(str(exc).replace(exc.param, param), param) from None
    stream = _or(body.stream, False)
    if body.stream_options is not None and not stream:  # as OpenAI: it would change nothing
        raise bad_request("stream_options needs stream: true", "stream_options")
    include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
    return GenerationRequest(
        kind, prompts, params, stream, include_usage and stream, cache_salt=body.cache_salt
    )


T = TypeVar("T", int, float, bool)


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _echo_text(prompt: list[int], tokenizer: TokenizerLike) -> str:
    """A token-id prompt's text for echo; ids outside the vocabulary are the engine's 400."""
    if not all(0 <= t < tokenizer.vocab_size for t in prompt):
        return ""  # engine.check_request refuses this prompt before anything is generated
    return tokenizer.decode(prompt)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """Token-id strings -> (id, bias) pairs; the ids' and biases' ranges are validate's."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _message(message: ChatMessage) -> dict[str, Any]:
    """A turn as the chat template wants it: content as text, the tool fields kept."""
    out = message.model_dump(exclude_none=True, by_alias=True)
    content = message.content
    if isinstance(content, list):
        out["content"] = "".join(part.text for part in content)
    elif content is None:
        # an assistant turn that only calls tools has none; templates index content, so text
        out["content"] = ""
    return out


def _tool_plan(
    chat: ChatCompletionBody, messages: list[dict[str, Any]], tokenizer: TokenizerLike
) -> ToolPlan | None:
    # Always planned, tools or not: a tool loop's last turn may come without tools, and its
    # earlier calls and results must still be rendered in the format the model saw them in.
    from kvpark.server.tools import plan_tools  # the tools layer imports this module's types

    return plan_tools(
        messages,
        chat.tools,
        chat.tool_choice,
        chat.parallel_tool_calls,
        tokenizer.chat_template or "",
    )
