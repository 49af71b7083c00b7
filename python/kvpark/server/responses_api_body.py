"""The ``POST /v1/responses`` body as pydantic models, and its translation to a chat body.

The Responses API is served by the chat path: :func:`to_chat` turns a validated
:class:`ResponsesBody` into an OpenAI chat-completions body, which ``parse_chat`` reads like any
other. Every field is declared here, so an unknown one is a 400 (``extra="forbid"``); a declared
field is honoured, refused with a 400 naming it (:func:`refusals`), or one of the documented
no-ops (``metadata``, ``user``, ``service_tier``, ``truncation: "disabled"``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, TypeAdapter, ValidationError

from kvpark.server.errors import APIError, bad_request
from kvpark.server.schema import Body

Role = Literal["user", "assistant", "system", "developer"]


def _text_as_parts(value: object) -> object:
    """A bare string content is one ``input_text`` part: one shape for the rest of the code (and
    an error's location names the part, not a union branch)."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


def _text_as_message(value: object) -> object:
    """``input: "..."`` is one user message."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class InputText(Body):
    type: Literal["input_text"]
    text: str


class OutputText(Body):
    """An earlier answer's text part, as a client sends ``response.output`` back; its
    ``annotations`` and ``logprobs`` are history and change nothing."""

    type: Literal["output_text"]
    text: str
    annotations: list[object] = Field(default_factory=list)
    logprobs: list[object] | None = None


Part = Annotated[InputText | OutputText, Field(discriminator="type")]


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Role
    content: Annotated[list[Part], BeforeValidator(_text_as_parts)]
    # an output item sent back: its id and status name it, they change nothing
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content)


class FunctionCallItem(Body):
    """An earlier call of the model (a tool loop sends the response's output back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Body):
    """The client's result for ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def _item_kind(value: object) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else "message"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]
_ITEMS: TypeAdapter[list[Item]] = TypeAdapter(list[Item])


def as_items(output: object) -> tuple[Item, ...]:
    """A response's output items as input items (a message, or a function call), as a client
    that sends ``response.output`` back would: what ``previous_response_id`` continues with."""
    return tuple(_ITEMS.validate_python(output, strict=False))


class FunctionTool(Body):
    """The one tool type served: a function (web search, file search... are not tools here)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Body):
    format: Annotated[
        TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
    ] = TextFormat(type="text")


class ResponsesBody(Body):
    model: str | None = None
    input: Annotated[list[Item], BeforeValidator(_text_as_message), Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    # kept in the server's response store (server/response_store.py)
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    # refused unless off: no reasoning to configure, no logprobs here
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # "disabled" is what the server does (a prompt past the context is a 400); "auto" is refused
    truncation: Literal["auto", "disabled"] | None = None
    # accepted no-ops: they change no output by nature
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    # vLLM's: share cached pages only with requests of the same salt (see docs/server.md)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None


# Responses field -> what parse_chat and the engine call it, for their 400s' ``param``
CHAT_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
# pydantic's union branches and validator names in an error's location: not fields
_BRANCH = re.compile(
    r"^(str|int|bool|float|none|list\[.*|dict\[.*|literal\[.*|function-.*)$|^[A-Z]"
)


def parse_responses_body(body: dict[str, object]) -> ResponsesBody:
    """``body`` validated; a 400 naming the first bad field (``tools.0.type``) otherwise."""
    try:
        parsed = ResponsesBody.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(part) for part in first["loc"] if not _BRANCH.match(str(part))]
        param = ".".join(loc) or None
        if first["type"] == "extra_forbidden":
            message = f"unknown field {param!r}: this server does not support it"
            raise bad_request(message, param) from None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param) from None
    refusals(parsed)
    return parsed


def refusals(body: ResponsesBody) -> None:
    """The declared fields this server cannot honour, when set to what it cannot do (``store``,
    ``background`` and ``previous_response_id`` depend on the store: server/responses_api.py)."""
    if body.reasoning is not None:
        raise bad_request(
            "reasoning is not supported: the model has no reasoning mode", "reasoning"
        )
    if body.include:
        raise bad_request("include is not supported", "include")
    if body.top_logprobs is not None:
        raise bad_request("top_logprobs is not supported on /v1/responses", "top_logprobs")
    if body.truncation == "auto":
        raise bad_request(
            "truncation: auto is not supported (a prompt past the context is refused)",
            "truncation",
        )


def to_chat(body: ResponsesBody) -> dict[str, object]:
    """The chat-completions body that generates this response."""
    chat: dict[str, object] = {"messages": _messages(body)}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.temperature is not None:
        chat["temperature"] = body.temperature
    if body.top_p is not None:
        chat["top_p"] = body.top_p
    if body.tools is not None:
        chat["tools"] = [_chat_tool(tool) for tool in body.tools]
    if isinstance(body.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    response_format = _response_format(body.text)
    if response_format is not None:
        chat["response_format"] = response_format
    if body.stream is not None:
        chat["stream"] = body.stream
    if body.cache_salt is not None:
        chat["cache_salt"] = body.cache_salt
    return chat


def _messages(body: ResponsesBody) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    for item in body.input:
        if isinstance(item, MessageItem):
            # developer messages are the system turn in the chat templates we render
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # calls of one turn (parallel calls, or after its text) stay one assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def _chat_tool(tool: FunctionTool) -> dict[str, object]:
    function: dict[str, object] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def _response_format(text: TextConfig | None) -> dict[str, object] | None:
    fmt = None if text is None else text.format
    if isinstance(fmt, JsonObjectFormat):
        return {"type": "json_object"}
    if isinstance(fmt, JsonSchemaFormat):
        schema: dict[str, object] = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.description is not None:
            schema["description"] = fmt.description
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": schema}
    return None


def chat_error(error: APIError) -> APIError:
    """An error of the chat path, its ``param`` renamed to the Responses field."""
    param = CHAT_PARAMS.get(error.param or "", error.param)
    if param == error.param:
        return error
    message = error.message
    if error.param is not None:
        message = message.replace(error.param, str(param))
    return APIError(error.status, message, error.kind, param)
