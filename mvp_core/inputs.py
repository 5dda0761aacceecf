"""Untrusted inputs of a run: the payloads of its signals and updates.

Anyone who can reach the Temporal namespace can signal a run (the ``temporal`` CLI, the
Web UI, a stale node), so every payload is decoded here into its typed message or
refused with a reason that names what is wrong, never the content (which may carry
secrets or user text). A refused signal is counted and described in the run's
snapshot; a refused update is a typed, non-retryable error for its caller. No payload,
however malformed, can fail the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from mvp_core.validation import describe_invalid, json_kind

M = TypeVar("M", bound=BaseModel)


class InvalidInput(ValueError):
    """A payload the run does not act on; ``reason`` is safe to log and show."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


class NotJson:
    """Stands for a payload that did not decode as JSON."""


def decode_one(
    kind: str, model: type[M], values: Sequence[Any], *, missing_is_default: bool = False
) -> M:
    """The one typed message of a signal or update from its decoded payload values.

    ``missing_is_default``: no payload (or JSON null) means the model's defaults, e.g.
    ``request_shutdown`` with no input is an operator shutdown.
    """
    name = model.__name__
    if len(values) > 1:
        raise InvalidInput(kind, f"expected one {name} payload, got {len(values)}")
    value = values[0] if values else None
    if isinstance(value, NotJson):
        raise InvalidInput(kind, f"the payload is not JSON; expected a {name} object")
    if value is None:
        if missing_is_default:
            return model()
        raise InvalidInput(kind, f"missing payload: expected a {name} JSON object")
    if not isinstance(value, dict):
        raise InvalidInput(kind, f"expected a {name} JSON object, got {json_kind(value)}")
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise InvalidInput(kind, f"invalid {name}: {describe_invalid(err)}") from None
