"""A signal the run sends a prompt's workflow that has already ended (a cancel reached
it first, or it was closed from outside) is no fault of the run's: its end comes by the
child's result. Unguarded, the activation sent on the heels of a cancel once faulted a
whole run on a busy machine ("prompt serving: ... failed (ApplicationError)")."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from mvp_core import names
from workflows.run.prompts import _tell


@workflow.defn(sandboxed=False)
class EndsAtOnce:
    @workflow.run
    async def run(self) -> str:
        return "ended"

    @workflow.signal(name=names.SIGNAL_PROMPT_ACTIVATE)
    def activate(self) -> None:
        pass


@workflow.defn(sandboxed=False)
class SignalsAnEndedChild:
    @workflow.run
    async def run(self, raw: bool) -> str:
        child = await workflow.start_child_workflow(
            EndsAtOnce.run, id=f"{workflow.info().workflow_id}-child"
        )
        ended = await child
        # The child is closed on the server: a raw signal fails (the SDK's ApplicationError,
        # which would fail this workflow); the run's own way logs it and goes on.
        if not raw:
            await _tell(child, "the child", names.SIGNAL_PROMPT_ACTIVATE)
            return ended
        try:
            await child.signal(names.SIGNAL_PROMPT_ACTIVATE)
        except Exception as err:
            return type(err).__name__
        return "delivered"


async def test_a_signal_to_a_prompt_workflow_that_has_ended_does_not_fail_the_run(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    async with Worker(
        env.client,
        task_queue=task_queue,
        workflows=[EndsAtOnce, SignalsAnEndedChild],
    ):
        # What _tell guards against really happens: the raw signal fails.
        raw = await env.client.execute_workflow(
            SignalsAnEndedChild.run,
            True,
            id=f"{task_queue}-raw",
            task_queue=task_queue,
            execution_timeout=timedelta(seconds=60),
        )
        told = await env.client.execute_workflow(
            SignalsAnEndedChild.run,
            False,
            id=f"{task_queue}-told",
            task_queue=task_queue,
            execution_timeout=timedelta(seconds=60),
        )
    assert raw == "ApplicationError"
    assert told == "ended"
