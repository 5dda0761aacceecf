"""What the run client raises: typed refusals and the states of a run or prompt that a
caller acts on (retry, give up, say why), apart from the SDK's own errors."""

from __future__ import annotations

from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError


class PromptRejected(Exception):
    """The run refused the prompt; ``kind`` is the typed rejection (DECISIONS 9)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class PromptNotFound(LookupError):
    """No prompt of that request id was ever admitted by the run."""


class PromptUnavailable(Exception):
    """The run could not say where a prompt is now (no worker has it): try again."""


class RunNotOpen(Exception):
    """The run does not exist, cannot be described, or has ended (the message says which)."""


class RunClosed(Exception):
    """The run closed while the caller waited for it to become prompt-ready. ``error`` is
    how its result failed (a ``WorkflowFailureError`` for a rejected or faulted run), None
    when it closed without a failure."""

    def __init__(self, workflow_id: str, error: BaseException | None) -> None:
        super().__init__(
            f"run {workflow_id} closed before it was prompt-ready"
            + (f": {error}" if error is not None else "")
        )
        self.error = error


def copy_error(err: Exception) -> Exception:
    """An error of its own for each of many callers that one call failed (one raised in
    many tasks would gather their tracebacks)."""
    if isinstance(err, PromptRejected):
        return PromptRejected(err.kind, str(err))
    if isinstance(err, RPCError):  # its status is what callers act on
        return RPCError(err.message, err.status, err.raw_grpc_status)
    try:
        copy = type(err)(*err.args)
    except Exception:
        return err  # not made again: the same one (its type is what callers act on)
    return copy if type(copy) is type(err) else err


def rejection(err: WorkflowUpdateFailedError) -> PromptRejected:
    """The ``submit_prompt`` validator's refusal, typed by its ApplicationError type."""
    cause = err.cause
    if isinstance(cause, ApplicationError):
        return PromptRejected(cause.type or "Rejected", cause.message)
    return PromptRejected("Rejected", str(cause or err))
