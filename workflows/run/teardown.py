"""Teardown (DECISIONS 16), on every exit path but continue-as-new: open prompts are
cancelled, leases end, StopRun goes to every stage that may run and StageStopped is
awaited, every node gets its provider stop (attempted for all, the first error kept),
and RunTornDown is recorded exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.models import LifecycleKind, NodeHandle, RunPhase, StopNodeInput, StopRun
    from mvp_core.providers import traits
    from mvp_core.run_records import NodeState
    from workflows import calls
    from workflows.prompt import failure_cause
    from workflows.run.context import RunContext, abandon
    from workflows.run.membership import Membership
    from workflows.run.prompts import Prompts

HANDLERS_DRAIN = timedelta(seconds=30)


class Teardown:
    """Stops everything the run started, each thing once."""

    def __init__(self, ctx: RunContext, membership: Membership, prompts: Prompts) -> None:
        self._ctx = ctx
        self._membership = membership
        self._prompts = prompts

    async def run(self) -> None:
        """StopRun, StageStopped, provider stop, RunTornDown once."""
        ctx, state = self._ctx, self._ctx.state
        ctx.view.set_phase(RunPhase.TEARING_DOWN)
        state.record(LifecycleKind.RUN_TEARING_DOWN, state.first_fault or (state.shutdown or ""))
        await self._prompts.cancel_all(
            "run is shutting down"
            if state.first_fault is None
            else f"run faulted: {state.first_fault}"
        )
        # Leases end now; the provider watch runs on so that a node dying now is skipped.
        await self._membership.cancel(watch=False)
        await self._stop_stages()
        await asyncio.gather(*(self.stop_node(n) for n in state.nodes_to_stop()))
        await self._membership.cancel(leases=False)
        head = state.head() if state.nodes else None
        if head is not None and (head.provider_stopped or head.exited):
            # Its node is gone: a prompt whose generate did not end on its cancel, stop
            # or StopRun need not wait for its heartbeat timeout (DECISIONS 101).
            await self._prompts.tell_head_gone(head)
        if state.uses_token_endpoints:
            # The token endpoints live on the head's driver; its StopRun tears them down.
            head = state.head()
            state.token_endpoints_stopped = head.stage_stopped or head.provider_stopped
        await self._prompts.drain()
        state.record(LifecycleKind.RUN_TORN_DOWN, state.first_stop_error or "")
        ctx.view.set_phase(RunPhase.TORN_DOWN)
        drained: Callable[[], bool] = workflow.all_handlers_finished
        if workflow.patched(names.PATCH_SHUTDOWN_WAITS_CLOSE):
            # A shutdown Update waits for the run's close (DECISIONS 59): not for this.
            drained = lambda: ctx.busy_handlers == 0  # noqa: E731
        try:
            await workflow.wait_condition(drained, timeout=HANDLERS_DRAIN.total_seconds())
        except TimeoutError:
            workflow.logger.warning("prompt handlers still open after teardown")

    async def _stop_stages(self) -> None:
        """StopRun to every stage that may run, then StageStopped from each, in time."""
        state, t = self._ctx.state, self._ctx.request.timeouts
        await asyncio.gather(*(self._stop_stage(n) for n in state.stages_to_stop()))
        try:
            await workflow.wait_condition(
                state.stage_stops_observed, timeout=max(t.stage_stopped_wait_s, 0.001)
            )
        except TimeoutError:
            missing = [n.stage_index for n in state.stages_to_stop() if not n.stage_stopped]
            state.stop_error(f"StageStopped not observed for stage(s) {missing}")

    async def _stop_stage(self, node: NodeState) -> None:
        state = self._ctx.state
        node.stop_sent = True
        task = asyncio.ensure_future(
            calls.stop_stage(
                StopRun(
                    run_id=state.run_id,
                    stage_index=node.stage_index,
                    readiness_id=node.readiness_id,
                    authorized_orchestrator=state.authorized_orchestrator,
                    reason=state.first_fault or "operator stop",
                ),
                node.task_queue,
                self._ctx.request.timeouts,
                f"stop stage {node.stage_index} on node {node.node_id}",
            )
        )
        await workflow.wait_condition(lambda: task.done() or node.exited)
        if not task.done():
            abandon(task)  # the node is gone: nothing left to stop there
            return
        try:
            await task
        except ActivityError as err:
            state.stop_error(
                f"StopRun stage {node.stage_index} (node {node.node_id}): {failure_cause(err)}"
            )

    async def stop_node(self, node: NodeState) -> bool:
        """The provider stop of ``node``: False where it failed (a node that may still run)."""
        state, t = self._ctx.state, self._ctx.request.timeouts
        stopped = True
        assert state.provider_queue is not None
        handle = node.handle or NodeHandle(  # a start that never reported back
            run_id=state.run_id,
            node_id=node.node_id,
            provider=self._ctx.request.provider,
            host="",
            resource_name=names.node_resource_name(state.run_id, node.node_id, state.nonce),
        )
        try:
            result = await calls.stop_node(
                StopNodeInput(handle=handle, grace_s=t.stop_grace_s),
                state.provider_queue,
                traits(handle.provider).stop_allowance_s,
                f"provider stop node {node.node_id} (stage {node.stage_index})",
            )
            if result.error is not None:
                stopped = False
                state.stop_error(
                    f"provider stop node {node.node_id}: {result.error}", provider=True
                )
        except ActivityError as err:
            stopped = False
            state.stop_error(
                f"provider stop node {node.node_id}: {failure_cause(err)}", provider=True
            )
        node.provider_stopped = True
        return stopped
