"""Request bodies as pydantic models: an unknown field or a wrong type is a 400 that names it.

Every API family declares its bodies as subclasses of :class:`Body` (``extra="forbid"``: the "no
field silently ignored" rule as a mechanism) and reads them with :func:`parse_body`, which maps
pydantic's validation errors to one :class:`APIError` naming the first bad field. Each route turns
that error into its own API's shape.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kvpark.server.errors import APIError, bad_request

B = TypeVar("B", bound="Body")


class Body(BaseModel):
    """Base of every request body: unknown fields refused, no coercion between JSON types."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def parse_body(model: type[B], body: dict[str, object]) -> B:
    """``body`` validated as ``model``; a 400 naming the first bad field otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        message = f"unknown field {param!r}: this server does not support it"
    else:
        message = f"{param}: {first['msg']}" if param else first["msg"]
    return bad_request(message, param)
