"""A survivor's fault report (an edge its dead peer closed) is first a suspicion: the
provider watch gets a moment to name the node that died (the first fault names it, or
its loss is replaced); past that grace the report itself faults the run."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from mvp_core.models import NodeLossPolicy
    from workflows.run.context import RunContext

# The provider watch polls every 0.5 s: the first fault names the node that died.
CULPRIT_GRACE = timedelta(seconds=2)
# ... and longer where the run replaces lost nodes (DECISIONS 68): a rented instance's
# status is polled every 5 s, and a loss the watch names is replaced, not fatal.
REPLACE_CULPRIT_GRACE = timedelta(seconds=10)


class Suspicion:
    """The grace between a suspected fault and its confirmation."""

    def __init__(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self._grace: asyncio.Task[None] | None = None

    def suspect(self, reason: str) -> None:
        if self._ctx.state.suspect(reason):
            self.start_grace()

    def start_grace(self) -> None:
        """Give the provider watch a moment to find the node that died, then fault with
        the report if none did."""
        if self._grace is not None:
            return
        state = self._ctx.state
        grace = CULPRIT_GRACE
        if self._ctx.request.on_node_loss is NodeLossPolicy.REPLACE:
            grace = REPLACE_CULPRIT_GRACE

        async def confirm() -> None:
            try:
                await workflow.wait_condition(
                    lambda: state.stopping or state.suspected_fault is None,
                    timeout=grace.total_seconds(),
                )
            except TimeoutError:
                pass
            state.confirm_suspected()
            self._grace = None  # a later suspicion has a grace of its own

        self._grace = asyncio.ensure_future(confirm())
