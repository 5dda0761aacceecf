"""The run's start input: a RunRequest from a client or the CLI, or the RunCarry that
continue-as-new hands to the next execution of the same workflow id. It arrives raw, so
that a malformed request is rejected naming its bad fields instead of failing every
workflow task while the SDK decodes it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from temporalio import workflow
from temporalio.common import RawValue

with workflow.unsafe.imports_passed_through():
    from mvp_core.models import RunRequest, ServedPrompt
    from mvp_core.run_state import RunState
    from mvp_core.validation import RunRejectedError, describe_invalid, parse_request


class RunCarry(BaseModel):
    """What continue-as-new hands to the next run of the same workflow id."""

    model_config = ConfigDict(extra="forbid")
    request: RunRequest
    state: RunState
    served: list[ServedPrompt] = Field(default_factory=list)  # run-hosted prompts' ends


_CARRY_KEYS = frozenset(RunCarry.model_fields)


def decode_start(start: RawValue) -> RunRequest | RunCarry:
    """The RunCarry of continue-as-new, or a RunRequest validated field by field
    (RunRejectedError names what is wrong)."""
    try:
        raw = workflow.payload_converter().from_payload(start.payload)
    except Exception:
        raise RunRejectedError("invalid run request: the input is not JSON") from None
    if not (isinstance(raw, dict) and {"request", "state"} <= raw.keys() <= _CARRY_KEYS):
        return parse_request(raw)
    try:
        return RunCarry.model_validate(raw)
    except ValidationError as err:
        raise RunRejectedError(f"invalid run carry: {describe_invalid(err)}") from None
