"""The run's signals, decoded here: every payload is untrusted (the CLI, the Web UI, a
stale node). A node's report goes to its ``RunState`` rule through the core's one table
(``mvp_core.run_signals``); what is malformed, mismatched or unknown is ignored,
counted and described in ``snapshot`` and the worker log; none can fail the run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RawValue

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.inputs import InvalidInput, NotJson, decode_one
    from mvp_core.run_signals import REPORT_RULES, RUN_SIGNALS
    from mvp_core.run_state import RunState


def decode_signal(name: str, args: Sequence[RawValue]) -> BaseModel | str:
    """The signal's message, or why it is ignored."""
    model = RUN_SIGNALS.get(name)
    if model is None:
        return "unknown signal"
    values: list[Any] = []
    for raw in args:
        try:
            values.append(workflow.payload_converter().from_payload(raw.payload))
        except Exception:
            values.append(NotJson())
    try:
        return decode_one(
            name, model, values, missing_is_default=name == names.SIGNAL_REQUEST_SHUTDOWN
        )
    except InvalidInput as err:
        return err.reason


def apply_report(state: RunState, name: str, message: BaseModel) -> bool:
    """A node's report to its RunState rule; False where ``name`` is not a report."""
    rule = REPORT_RULES.get(name)
    if rule is None:
        return False
    rule[1](state, message)
    return True


def ignore(state: RunState, kind: str, reason: str) -> None:
    state.ignore(kind, reason)
    workflow.logger.warning("ignored %s: %s", kind, reason)
