"""The OpenAI chat and completions request bodies as pydantic models: every field declared.

Each field is one of three kinds, listed with its status in ``docs/server.md``:

- honoured: it reaches the prompt, the :class:`SamplingParams` or the response;
- refused: declared so that a client sending it gets a 400 naming it (``audio``, ``prediction``...)
  rather than "unknown field"; :mod:`kvpark.server.openai_refusals` says why for each;
- accepted no-op: ``user``, ``metadata``, ``store``, ``service_tier``, which by their nature change
  no output (nothing is stored: ``store`` only asks OpenAI to keep the exchange for its dashboards).

``null`` means "not given" for every optional field, as in the OpenAI API. Types are strict (no
coercion between JSON types); ranges are left to :meth:`SamplingParams.validate`, so the limits
live in one place.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvpark.server.schema import Body

JSONObject = dict[str, Any]


class StreamOptions(Body):
    include_usage: bool | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    """One turn. ``content`` may be ``null`` (an assistant turn that only calls tools); the tool
    fields are kept as given for the chat template and the tools layer to render."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[JSONObject] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: which call this result answers
    refusal: str | None = None  # assistant: a refusal OpenAI returned earlier; text for us


class JSONSchemaFormat(Body):
    name: str
    description: str | None = None
    schema_: JSONObject | None = Field(default=None, alias="schema")
    strict: bool | None = None  # our grammar always enforces the schema: strict or not


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingBody(Body):
    """Fields both routes share: the sampling knobs, stops, streaming and the extensions."""

    model: str | None = None  # checked against the served model's names by the route
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None  # token-id strings -> bias
    user: str | None = None  # no-op: an end-user id for OpenAI's abuse monitoring
    # structured output (OpenAI, then llama.cpp's and vLLM's spellings); at most one per request
    response_format: ResponseFormat | None = None
    grammar: str | None = None  # llama.cpp: GBNF
    json_schema: JSONObject | None = None  # llama.cpp: a JSON schema
    guided_json: JSONObject | str | None = None  # vLLM: a schema, as an object or JSON text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # vLLM: GBNF
    # vLLM / llama.cpp sampling extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    best_of: int | None = None  # only n (no ranking of extra samples)
    # vLLM's: share cached pages only with requests of the same salt (see docs/server.md)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None


class ChatCompletionBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[JSONObject] | None = None
    tool_choice: str | JSONObject | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None  # only ["text"]
    # accepted no-ops
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # refused (see openai_refusals)
    audio: JSONObject | None = None
    prediction: JSONObject | None = None
    web_search_options: JSONObject | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    functions: list[JSONObject] | None = None
    function_call: str | JSONObject | None = None


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
