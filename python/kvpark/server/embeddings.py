"""``POST /v1/embeddings``: OpenAI's embeddings API for the served model.

An input's embedding is the model's last hidden state after the final norm, mean-pooled over the
input's tokens and L2-normalised (runner/embedding.py computes it on the engine thread, between
steps, over a temporary K/V cache: no pool cell is ever held). Inputs are tokenized as
``/v1/completions`` prompts are (with the tokenizer's special tokens), or given as token ids.

Fields: ``input`` (a string, a list of strings, a list of token ids or a list of token-id lists; at
most :data:`MAX_INPUTS`, none empty), ``model`` (the served model's names), ``encoding_format``
(``float`` or ``base64``: little-endian float32 bytes, base64-encoded, as the ``openai`` client
decodes them), ``dimensions`` (honoured only when it is the embedding's own length, the hidden
size: this model has no shorter embeddings to give) and ``user`` (accepted, changes nothing).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from pydantic import field_validator
from pydantic_core import PydanticCustomError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpark.engine.llm_engine import RequestRejected
from kvpark.server.disconnect import unless_disconnected
from kvpark.server.errors import APIError, bad_request
from kvpark.server.prompts import encode_within
from kvpark.server.schema import Body, parse_body

if TYPE_CHECKING:
    from kvpark.engine.async_engine import AsyncEngine
    from kvpark.tokenizer.tokenizer import Tokenizer

MAX_INPUTS = 256  # per request; each runs a forward of its own on the engine thread
Input = str | list[str] | list[int] | list[list[int]]


class EmbeddingsBody(Body):
    input: Input
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted no-op: it names the caller, it changes no vector

    @field_validator("input", mode="plain")
    @classmethod
    def _input(cls, value: object) -> Input:
        """The four shapes OpenAI takes, nothing else (a plain validator: one message, named
        ``input``, instead of one per member of the union)."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise _bad_input(
                "must be a string, a list of strings, a list of token ids or a list of token-id "
                "lists, and not empty"
            )
        if len(value) > MAX_INPUTS:
            raise _bad_input(f"at most {MAX_INPUTS} inputs per request")
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(_is_id(v) for v in value):
            return list(value)
        if all(isinstance(v, list) and all(_is_id(t) for t in v) for v in value):
            return [list(v) for v in value]
        raise _bad_input("the items must be all strings, all token ids or all token-id lists")


def _bad_input(message: str) -> PydanticCustomError:
    """A validation error whose message is ours alone (a ValueError's gets "Value error, ")."""
    return PydanticCustomError("input", message)


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompts(body: EmbeddingsBody, tokenizer: Tokenizer, max_model_len: int) -> list[list[int]]:
    """One token-id list per input, in order; a text over ``max_model_len`` tokens is refused."""
    value = body.input
    if isinstance(value, str):
        return [encode_within(tokenizer, value, True, max_model_len, "input")]
    if all(isinstance(v, str) for v in value):
        return [encode_within(tokenizer, str(v), True, max_model_len, "input") for v in value]
    if all(isinstance(v, int) for v in value):
        return [[int(v) for v in value if isinstance(v, int)]]
    return [list(v) for v in value if isinstance(v, list)]


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embeddings(
    engine: AsyncEngine,
    request: Request,
    raw: dict[str, object],
    check_model: Callable[[str | None], None],
    model_name: str,
) -> Response:
    """The route's work once the body is read: parse, check, embed, answer in OpenAI's shape."""
    body = parse_body(EmbeddingsBody, raw)
    check_model(body.model)
    # tokenizing many long inputs takes a while: off the event loop
    prompts = await run_in_threadpool(_prompts, body, engine.tokenizer, engine.max_model_len)
    try:
        engine.check_embedding(prompts)
        # a full wait queue (--max-waiting) is decided on the engine thread: the job's 503
        vectors = await unless_disconnected(request.receive, engine.embed(prompts))
    except RequestRejected as exc:
        raise APIError(exc.code, exc.message, exc.kind, exc.param) from None
    if vectors is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    size = len(vectors[0])
    if body.dimensions is not None and body.dimensions != size:
        raise bad_request(
            f"dimensions: this model's embeddings have {size} dimensions and cannot be "
            f"shortened; omit dimensions or give {size}",
            "dimensions",
        )
    n_tokens = sum(len(p) for p in prompts)
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                for i, v in enumerate(vectors)
            ],
            "model": model_name,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )
