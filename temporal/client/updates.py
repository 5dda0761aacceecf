"""How the client sends the run its Updates and holds their results: an Update the
server aborted before acceptance is sent again, and a result task left behind never
reports an unread error."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from temporalio.service import RPCError

T = TypeVar("T")

# An Update the server aborted before it was accepted, because the workflow task it rode
# on failed (e.g. the server refused a continue-as-new completion that raced with it):
# ``WorkflowNotReady``. Nothing of the Update happened, so it is sent again, with the same
# id, this many times at most, after a growing pause.
NOT_READY_RETRIES = 20
NOT_READY_PAUSE_S = 0.05
# After an Update is accepted: is its outcome known already (a validator's rejection comes
# back with the acceptance)? A result call this short answers from what the handle knows,
# and otherwise gives up at once; it never waits for the prompt.
OUTCOME_PEEK = timedelta(milliseconds=1)


def not_ready(err: RPCError) -> bool:
    """The server's WorkflowNotReady answer to an Update (never accepted, safe to resend)."""
    try:
        details = err.grpc_status.details
    except Exception:  # an undecodable status is not that answer
        return False
    return any(d.type_url.endswith("WorkflowNotReadyFailure") for d in details)


async def resent_when_not_ready(send: Callable[[], Awaitable[T]]) -> T:
    """``send()``, again after a pause when the server answers WorkflowNotReady."""
    for attempt in range(NOT_READY_RETRIES):
        try:
            return await send()
        except RPCError as err:
            if not not_ready(err) or attempt == NOT_READY_RETRIES - 1:
                raise
        await asyncio.sleep(NOT_READY_PAUSE_S * (attempt + 1))
    raise AssertionError("unreachable")


def drop(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` if it still runs, and never leave its end unread: a cancelled
    Update result ends with the SDK's own error, which asyncio would report as "never
    retrieved"."""
    if not task.done():
        task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
