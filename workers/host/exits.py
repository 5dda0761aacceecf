"""How ``mvp-orchestrator`` ends: its name on stderr, the one-line error that exits 1
(:class:`HostError`), and the exit status a closed run maps to: 0 only when the run
stopped for the operator and tore everything down."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from mvp_core.datastream import BootstrapPhase, BootstrapStatus
from mvp_core.errors import ErrorType
from mvp_core.models import RunOutcome
from mvp_io.datastream import Datastream
from workers import stdio
from workers.host.embedded import failure_text

PROG = "mvp-orchestrator"
say = stdio.sayer(PROG)


class HostError(Exception):
    """Why the host cannot go on, in one line; the host exits 1."""


def bind_failed(bind_error: str | None) -> int:
    """0, or the HostError of a prompt RPC that could not bind (its run was shut down)."""
    if bind_error:
        raise HostError(bind_error)
    return 0


def closed_code(closed: asyncio.Future[Any], stream: Datastream, bind_error: str | None) -> int:
    """The exit status of a session whose run has closed (``closed``: its result): 0 for
    an operator's stop, else the HostError that says how the run ended."""
    err = closed.exception() if not closed.cancelled() else None
    if isinstance(err, WorkflowFailureError):
        cause = err.cause
        if isinstance(cause, ApplicationError) and cause.type == ErrorType.RUN_STOP_FAILED:
            raise HostError(f"provider stop failed: {cause.message}")
        raise HostError(failure_text(err))
    if err is not None:
        raise HostError(f"run ended: {err}")
    outcome = RunOutcome.model_validate(closed.result())
    stream.bootstrap(
        BootstrapPhase.SHUTDOWN, BootstrapStatus.READY, {"outcome": outcome.outcome.value}
    )
    if outcome.outcome.value != "operator_stopped":
        raise HostError(f"run ended: {outcome.outcome.value}")
    return bind_failed(bind_error)
