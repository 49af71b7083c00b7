"""``POST /tokenize`` and ``POST /detokenize`` (llama.cpp's utility routes): their bodies as
pydantic models, so an unknown field is a 400 naming it here too."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from kvpark.server.errors import bad_request
from kvpark.server.protocol import TokenizerLike
from kvpark.server.schema import Body, parse_body


class TokenizeBody(Body):
    content: str
    add_special: bool = False  # the tokenizer's BOS (and the like) around the text
    with_pieces: bool = False  # each id with its text piece


class DetokenizeBody(Body):
    tokens: list[int]


async def tokenize(body: dict[str, object], tokenizer: TokenizerLike) -> dict[str, object]:
    req = parse_body(TokenizeBody, body)
    tokens = await run_in_threadpool(
        tokenizer.encode, req.content, add_special_tokens=req.add_special
    )
    if req.with_pieces:
        return {"tokens": [{"id": t, "piece": tokenizer.token_to_str(t)} for t in tokens]}
    return {"tokens": tokens}


def detokenize(body: dict[str, object], tokenizer: TokenizerLike) -> dict[str, object]:
    req = parse_body(DetokenizeBody, body)
    bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise bad_request(
            f"invalid tokens: {bad[:8]} outside [0, {tokenizer.vocab_size})", "tokens"
        )
    return {"content": tokenizer.decode(req.tokens)}
