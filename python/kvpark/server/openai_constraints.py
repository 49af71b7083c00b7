"""A request's structured-output field -> one :class:`Constraint`, whatever the spelling.

OpenAI's ``response_format``, llama.cpp's ``grammar`` / ``json_schema`` and vLLM's ``guided_*``
fields all say the same thing; a request may use one of them. The constraint keeps the field's
name as ``param`` so a schema or grammar the sampling layer cannot compile is a 400 naming it.
"""

from __future__ import annotations

import json

from kvpark.sampling.params import Constraint
from kvpark.server.errors import bad_request
from kvpark.server.openai_bodies import SamplingBody


def body_constraint(body: SamplingBody) -> Constraint | None:
    """The body's constraint, if any; a 400 naming the second field if it has two."""
    found = [c for c in _candidates(body) if c is not None]
    if len(found) > 1:
        raise bad_request(
            f"{found[0].param} and {found[1].param} both constrain the output; send one",
            found[1].param,
        )
    return found[0] if found else None


def _candidates(body: SamplingBody) -> list[Constraint | None]:
    return [
        _response_format(body),
        None if body.grammar is None else Constraint("gbnf", body.grammar, "grammar"),
        None if body.json_schema is None else _schema(body.json_schema, "json_schema"),
        None if body.guided_json is None else _schema(body.guided_json, "guided_json"),
        None
        if body.guided_regex is None
        else Constraint("regex", body.guided_regex, "guided_regex"),
        None if body.guided_choice is None else _choice(body.guided_choice),
        None
        if body.guided_grammar is None
        else Constraint("gbnf", body.guided_grammar, "guided_grammar"),
    ]


def _response_format(body: SamplingBody) -> Constraint | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise bad_request("json_schema needs type json_schema", "response_format")
        return None
    if fmt.type == "json_object":
        return Constraint("json_object", "", "response_format")
    if fmt.json_schema is None:
        raise bad_request("type json_schema needs a json_schema object", "response_format")
    # no schema at all: any JSON value, as OpenAI's API reads it
    schema = {} if fmt.json_schema.schema_ is None else fmt.json_schema.schema_
    return _schema(schema, "response_format")


def _schema(schema: dict[str, object] | str, param: str) -> Constraint:
    if isinstance(schema, str):  # vLLM takes the schema as JSON text too
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(schema, dict | bool):
            raise bad_request(f"{param} must be a JSON schema object", param)
    return Constraint("json_schema", json.dumps(schema), param)


def _choice(choices: list[str]) -> Constraint:
    if not choices:
        raise bad_request("guided_choice needs at least one choice", "guided_choice")
    return Constraint("choice", json.dumps(choices), "guided_choice")
