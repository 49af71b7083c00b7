"""The Anthropic Messages request body (``POST /v1/messages``) as pydantic models.

Every field the API defines that this server knows is declared here, and each is honoured, refused
with a 400 naming it, or a documented no-op (``metadata``, ``service_tier``, ``cache_control``:
they change no output). Anything else is an unknown field, a 400 naming it (``extra="forbid"``).
:mod:`kvpark.server.messages_api_chat` turns a parsed body into a chat-completions body.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from kvpark.server.schema import Body

# Blocks this server cannot read (no vision, no documents) or that only Anthropic's own servers
# produce: a 400 that names them rather than an "unknown block" puzzle.
REFUSED_BLOCKS = frozenset(
    {
        "image",
        "document",
        "search_result",
        "thinking",
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
        "container_upload",
    }
)


def _refuse_block_types(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") in REFUSED_BLOCKS:
        raise ValueError(f"{value['type']} content blocks are not supported by this server")
    return value


class CacheControl(Body):
    """Prompt-caching hint: a no-op here (kvpark's prefix cache reuses every shared prefix)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(Body):
    """A tool call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Body):
    """The client's answer to a ``tool_use``: becomes a chat ``role: tool`` message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        if isinstance(value, list):
            for block in value:
                _refuse_block_types(block)
        return value

    @model_validator(mode="after")
    def _blocks_fit_role(self) -> Message:
        if isinstance(self.content, list):
            for block in self.content:
                if self.role == "user" and isinstance(block, ToolUseBlock):
                    raise ValueError("tool_use blocks belong in assistant turns")
                if self.role == "assistant" and isinstance(block, ToolResultBlock):
                    raise ValueError("tool_result blocks belong in user turns")
        return self


class Tool(Body):
    """A client tool; Anthropic's server tools (web search, code execution...) are refused."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # handed on as the function's ``strict``
    eager_input_streaming: bool | None = None  # no-op: arguments always stream as generated
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") not in (None, "custom"):
            raise ValueError(f"server tool {value['type']!r} is not supported by this server")
        return value


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type 'tool' and only with it")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ValueError("disable_parallel_tool_use does not apply to type 'none'")
        return self


class Metadata(Body):
    """Accepted no-op: it changes no output (Anthropic uses it for abuse tracking)."""

    user_id: str | None = None


class Thinking(Body):
    """Extended thinking: only ``disabled`` is accepted (the model has no thinking mode)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _disabled_only(self) -> Thinking:
        if self.type != "disabled":
            raise ValueError(f"thinking {self.type!r} is not supported: the model has no thinking")
        return self


class OutputFormat(Body):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(Body):
    """``format`` constrains the reply to a JSON schema (the grammar); ``effort`` is refused."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, effort: str | None) -> str | None:
        if effort is not None:
            raise ValueError("effort is not supported: the model has one effort")
        return effort


class MessagesBody(Body):
    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # Anthropic's range
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None  # accepted no-op
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted no-op: one tier
    thinking: Thinking | None = None  # only "disabled"
    output_config: OutputConfig | None = None
    # accepted no-ops: where and how fast Anthropic would run it, and prompt-caching hints
    # (kvpark's prefix cache reuses every shared prefix unasked)
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    cache_control: CacheControl | None = None
    # vLLM's: share cached pages only with requests of the same salt (see docs/server.md)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _int_is_a_number(cls, value: Any) -> Any:
        # strict mode refuses 1 for a float; JSON has one number type, so 0 and 1 are fine
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("messages")
    @classmethod
    def _no_prefill(cls, messages: list[Message]) -> list[Message]:
        # A final assistant turn asks the model to continue it (prefill); the chat template
        # renders a new assistant turn instead, so it would be silently wrong: refused.
        if messages[-1].role == "assistant":
            raise ValueError(
                "a final assistant turn (prefill) is not supported: end with a user turn"
            )
        return messages
