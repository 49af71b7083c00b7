"""A completions ``prompt`` (and ``suffix``) -> token-id lists, and each prompt's text for echo.

``prompt`` is a string, a list of strings, a list of token ids or a list of token-id lists: one
engine request per prompt. ``suffix`` asks for fill-in-the-middle, which needs the model's FIM
tokens: with them the prompt becomes prefix-suffix-middle (``<fim_prefix>{prompt}<fim_suffix>
{suffix}<fim_middle>``, the order StarCoder-style models were trained on); without them a 400.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from kvpark.server.errors import bad_request

MAX_PROMPTS = 64
FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
P = TypeVar("P", str, list[int])


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def completion_prompts(
    prompt: str | list[str] | list[int] | list[list[int]],
    suffix: str | None,
    tokenizer: Encoder,
) -> tuple[list[list[int]], list[str] | None]:
    """The prompts' token ids, and their texts when they were given as text."""
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts = [p for p in prompt if isinstance(p, str)]
    else:
        texts = None
    if suffix is not None:
        if texts is None:
            raise bad_request("suffix needs a text prompt, not token ids", "suffix")
        return [_fill_in_the_middle(t, suffix, tokenizer) for t in _checked(texts)], texts
    if texts is not None:
        ids = [tokenizer.encode(t, add_special_tokens=True) for t in texts]
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


def _fill_in_the_middle(prefix: str, suffix: str, tokenizer: Encoder) -> list[int]:
    marks = [tokenizer.encode(t, add_special_tokens=False) for t in FIM_TOKENS]
    if not all(len(m) == 1 for m in marks):  # spelled out in pieces: the model has no FIM tokens
        raise bad_request(
            "suffix needs fill-in-the-middle tokens, which this model does not have", "suffix"
        )
    text = f"{FIM_TOKENS[0]}{prefix}{FIM_TOKENS[1]}{suffix}{FIM_TOKENS[2]}"
    return tokenizer.encode(text, add_special_tokens=False)
