"""A completions ``prompt`` (and ``suffix``) -> token-id lists, and each prompt's text for echo.

``prompt`` is a string, a list of strings, a list of token ids or a list of token-id lists: one
engine request per prompt. ``suffix`` asks for fill-in-the-middle, which needs the model's FIM
tokens: with them the prompt becomes prefix-suffix-middle (``<fim_prefix>{prompt}<fim_suffix>
{suffix}<fim_middle>``, the order StarCoder-style models were trained on); without them a 400.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from kvpark.server.errors import APIError, bad_request
from kvpark.tokenizer.tokenizer import PromptTooLong

MAX_PROMPTS = 64
FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
P = TypeVar("P", str, list[int])


class Encoder(Protocol):
    def encode(
        self, text: str, add_special_tokens: bool = ..., limit: int | None = ...
    ) -> list[int]: ...


def completion_prompts(
    prompt: str | list[str] | list[int] | list[list[int]],
    suffix: str | None,
    tokenizer: Encoder,
    max_model_len: int,
) -> tuple[list[list[int]], list[str] | None]:
    """The prompts' token ids, and their texts when they were given as text; a text over
    ``max_model_len`` tokens is refused (:func:`encode_within`)."""
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts = [p for p in prompt if isinstance(p, str)]
    else:
        texts = None
    if suffix is not None:
        if texts is None:
            raise bad_request("suffix needs a text prompt, not token ids", "suffix")
        fim = [_fill_in_the_middle(t, suffix, tokenizer, max_model_len) for t in _checked(texts)]
        return fim, texts
    if texts is not None:
        ids = [encode_within(tokenizer, t, True, max_model_len, "prompt") for t in texts]
    elif prompt and all(isinstance(t, int) for t in prompt):
        ids = [[t for t in prompt if isinstance(t, int)]]
    else:
        ids = [p for p in prompt if isinstance(p, list)]
    _checked(ids)
    return ids, texts


def _checked(prompts: list[P]) -> list[P]:
    if not prompts:
        raise bad_request("prompt must not be an empty list", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    if any(not p for p in prompts):
        raise bad_request("a prompt is empty", "prompt")
    return prompts


def encode_within(
    tokenizer: Encoder, text: str, add_special_tokens: bool, max_model_len: int, param: str
) -> list[int]:
    """``text``'s ids, or the context-size 400 (naming ``param``) when they are more than
    ``max_model_len``: found before the ids become a list, so an 8 MiB prompt does not hold the
    GIL while the streams beside it wait."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens, limit=max_model_len)
    except PromptTooLong as too_long:
        counted = f"{too_long.tokens} tokens"
        if too_long.counted_chars is not None:  # counted on the head of a far longer text
            counted = f"more: {counted} in its first {too_long.counted_chars} characters"
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {counted}. Please reduce the prompt."
        )
        raise APIError(400, message, "exceed_context_size_error", param) from None


def _fill_in_the_middle(
    prefix: str, suffix: str, tokenizer: Encoder, max_model_len: int
) -> list[int]:
    marks = [tokenizer.encode(t, add_special_tokens=False) for t in FIM_TOKENS]
    if not all(len(m) == 1 for m in marks):  # spelled out in pieces: the model has no FIM tokens
        raise bad_request(
            "suffix needs fill-in-the-middle tokens, which this model does not have", "suffix"
        )
    text = f"{FIM_TOKENS[0]}{prefix}{FIM_TOKENS[1]}{suffix}{FIM_TOKENS[2]}"
    return encode_within(tokenizer, text, False, max_model_len, "prompt")
