"""An activity task the run gives up on (a shutdown during planning or readiness, the
StopRun of a node already gone) ends with ActivityError('Activity cancelled'); the run
reads it, so its collection logs no "Task exception was never retrieved" (issue 21,
item 18). The same asyncio task machinery as the workflow's event loop."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from temporalio.exceptions import ActivityError, RetryState

from workflows.run.context import abandon as _abandon


def cancelled_activity_error() -> ActivityError:
    return ActivityError(
        "Activity cancelled",
        scheduled_event_id=1,
        started_event_id=2,
        identity="",
        activity_type="orch.prepare_plan",
        activity_id="2",
        retry_state=RetryState.CANCEL_REQUESTED,
    )


async def activity_like() -> None:
    """Like execute_activity with TRY_CANCEL: the cancel resolves it with an error."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        raise cancelled_activity_error() from None


def unretrieved_after(abandon: Any) -> list[str]:
    loop = asyncio.new_event_loop()
    seen: list[str] = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(str(ctx.get("message"))))

    async def run() -> None:
        task = asyncio.ensure_future(activity_like())
        await asyncio.sleep(0)
        abandon(task)
        await asyncio.sleep(0.01)  # the cancelled task finishes, unawaited
        assert task.done()

    try:
        loop.run_until_complete(run())
        gc.collect()
    finally:
        loop.close()
    return seen


def test_an_abandoned_activity_task_leaves_no_unretrieved_exception() -> None:
    assert unretrieved_after(_abandon) == []


def test_a_plainly_cancelled_one_did() -> None:
    """The control: what the run did before (task.cancel() and walk away)."""
    assert unretrieved_after(lambda task: task.cancel()) == ["Task exception was never retrieved"]
