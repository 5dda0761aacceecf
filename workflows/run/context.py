"""What every phase of a run shares: the request, the pure ``RunState``, the provider's
traits, the Web UI's view, and the two ways a phase waits (for a condition until a
deadline; for an activity that a stop abandons)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import TimeoutError as TimeoutError_

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.models import RunRequest
    from mvp_core.providers import ProviderTraits, traits
    from mvp_core.run_state import RunState
    from workflows.prompt import failure_cause, retrieve
    from workflows.run.view import RunView

T = TypeVar("T")

# The run's and its prompts' workflow task timeout (a worker lost mid-task costs this).
WORKFLOW_TASK_TIMEOUT = timedelta(seconds=names.WORKFLOW_TASK_TIMEOUT_S)

# A prompt (and the head holding one) waits this much longer than the run's bound on a
# recovery: the run, not a prompt, decides that a recovery failed (it then tears down).
RECOVERY_SLACK_S = 60.0


class Stopping(Exception):
    """The run started stopping while a step was waiting."""


class Rejected(Exception):
    """Planning rejected the run; nothing was provisioned."""


class RunContext:
    """The run's request and state, and what its phases do alike."""

    def __init__(self, request: RunRequest, state: RunState) -> None:
        self.request = request
        self.state = state
        self.traits: ProviderTraits = traits(request.provider)
        self.view = RunView(request, state)
        self.busy_handlers = 0  # prompt Updates and signal handlers in flight
        # Prompts this execution admitted: each one Update in its history, and a server
        # keeps at most 2,000 there (history.maxTotalUpdates; DECISIONS 77).
        self.admitted = 0
        self.closing = False  # torn down and every background activity ended: returns next

    async def wait(self, cond: Callable[[], bool], deadline: datetime, what: str) -> None:
        """Until ``cond`` holds; RuntimeError naming ``what`` past the deadline, Stopping
        if the run starts stopping meanwhile."""
        state = self.state
        remaining = (deadline - workflow.now()).total_seconds()
        try:
            await workflow.wait_condition(
                lambda: cond() or state.stopping, timeout=max(remaining, 0.001)
            )
        except TimeoutError:
            raise RuntimeError(f"{what} in time") from None
        if state.stopping:
            raise Stopping()

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Await an activity, but give up on it as soon as the run starts stopping."""
        task = asyncio.ensure_future(awaitable)
        await workflow.wait_condition(lambda: task.done() or self.state.stopping)
        if not task.done():
            abandon(task)
            raise Stopping()
        return task.result()


def slack(bound_s: float) -> float:
    """A prompt's wait for a recovery: the run's bound and RECOVERY_SLACK_S (at most a day)."""
    return min(bound_s + RECOVERY_SLACK_S, 86_400.0)


def now_ms() -> int:
    """Workflow time, in milliseconds since the epoch."""
    return int(workflow.now().timestamp() * 1000)


def abandon(task: asyncio.Task[Any]) -> None:
    """Cancel an activity the run no longer waits for. Its end (``ActivityError:
    Activity cancelled``) is taken here: left unread, the task's garbage collection
    logged it as "Task exception was never retrieved" in the worker's log."""
    task.add_done_callback(retrieve)
    task.cancel()


def describe(err: BaseException) -> str:
    """An error in words for a fault: an activity's cause, or the error's own message."""
    if isinstance(err, ActivityError):
        inner: BaseException = err
        while isinstance(inner, ActivityError) and inner.cause is not None:
            inner = inner.cause
        if isinstance(inner, TimeoutError_):
            # "Timeout" alone names nothing (process spec 10: the operation that failed).
            kind = inner.type.name.lower().replace("_", "-") if inner.type else "its"
            return f"activity {err.activity_type} timed out ({kind} timeout)"
        return failure_cause(err)
    if isinstance(err, ApplicationError):
        return err.message
    return f"{type(err).__name__}: {err}"
