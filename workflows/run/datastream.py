"""The run's datastream activity (DECISIONS 58): on the provider queue beside the
provider activities, from planning until the run's last record is published; recorded
histories without it replay without it."""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.models import RunDatastreamInput
    from workflows import calls
    from workflows.run.context import RunContext


class RunDatastream:
    """Starts the run's datastream once, and stops it after its last records."""

    def __init__(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        state = self._ctx.state
        if (
            self._task is not None
            or state.provider_queue is None
            or not workflow.patched(names.PATCH_RUN_DATASTREAM)
        ):
            return
        inp = RunDatastreamInput(
            run_id=state.run_id,
            run_workflow_id=workflow.info().workflow_id,
            provider=self._ctx.request.provider,
            nonce=state.nonce,
        )
        self._task = asyncio.ensure_future(calls.run_datastream(inp, state.provider_queue))

    async def stop(self) -> None:
        """Cancel the datastream and wait until it has published its last records."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, ActivityError):
            pass
