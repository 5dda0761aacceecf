"""Stage recovery (DECISIONS 68): a lost node is replaced through the same provider,
taken through the readiness barrier, and every stage wired into a new pipeline (the
survivors keep their weights); the head holds its prompts meanwhile and continues them
on the new pipeline. Membership hands each loss here (``on_loss``); where the run does not
replace nodes, ``RunState`` has already faulted and nothing starts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from mvp_core import metrics
    from mvp_core.models import NodeLossPolicy, PromptHead, RunPhase
    from mvp_core.run_records import NodeState
    from workflows.run.context import RunContext, Stopping, describe, now_ms
    from workflows.run.membership import Membership
    from workflows.run.prompts import Prompts
    from workflows.run.startup import Startup


class Recovery:
    """Replaces the run's lost nodes, one after another."""

    def __init__(
        self,
        ctx: RunContext,
        startup: Startup,
        membership: Membership,
        prompts: Prompts,
        stop_node: Callable[[NodeState], Awaitable[bool]],
    ) -> None:
        self._ctx = ctx
        self._startup = startup
        self._membership = membership
        self._prompts = prompts
        self._stop_node = stop_node
        self._task: asyncio.Task[None] | None = None
        self._news: list[asyncio.Task[None]] = []  # head-gone news on its way

    def on_loss(self) -> None:
        """A node was lost: replace it (and any lost after it), unless one is under way."""
        state = self._ctx.state
        if state.lost and self._task is None and not state.stopping:
            self._task = asyncio.ensure_future(self._recover())
        self._head_gone_news()

    def _head_gone_news(self) -> None:
        """A head node gone where no replacement will serve its prompts (a fail-stop run,
        or one that is stopping): its prompts are told (Prompts.tell_head_gone). A run
        that replaces it tells them in ``_replace``."""
        state = self._ctx.state
        if not state.nodes:
            return
        head = state.head()
        if not (head.exited or head.lease_lost):
            return
        if state.node_loss is NodeLossPolicy.REPLACE and not state.stopping:
            return
        self._news.append(asyncio.ensure_future(self._prompts.tell_head_gone(head)))

    async def stop(self) -> None:
        """The run ends: a replacement in flight stops where it is (a start in flight
        runs to its end, so that teardown knows the node it may have launched). A head
        lost as the stop came, which no replacement will serve now, is told to its
        prompts."""
        self._head_gone_news()
        task = self._task
        if task is None:
            return
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Stopping):
            pass

    async def _recover(self) -> None:
        state = self._ctx.state
        self._ctx.view.set_phase(RunPhase.RECOVERING)
        try:
            while state.lost and not state.stopping:
                await self._replace()
        except Stopping:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as err:
            rec = state.recovering
            stage = f"stage {rec.stage_index}" if rec is not None else "a stage"
            state.fault(f"prompt serving: recovery of {stage} failed: {describe(err)}")
        finally:
            self._task = None

    async def _replace(self) -> None:
        """Stop what is left of the lost node, start its replacement through the same
        provider, take it through the readiness barrier, wire every stage into a new
        pipeline and return to prompt-ready."""
        ctx, state, req = self._ctx, self._ctx.state, self._ctx.request
        lost_at = state.lost[0].lost_at_ms
        lost, node = state.begin_replacement(now_ms())
        ctx.view.show()
        # The bound runs from the loss, as the prompts' and the head's own waits do.
        deadline = workflow.now() + timedelta(
            seconds=req.recovery.replacement_timeout_s - (now_ms() - lost_at) / 1000
        )
        if node.stage_index == 0:
            await self._tell_prompts(node, ready=False)  # they wait for the new head
        self._membership.drop_lease(lost.node_id)  # the node is out of the run
        if not await self._stop_node(lost):  # a rental is destroyed, never left billing
            lost.provider_stopped = False  # teardown tries again
            raise RuntimeError(
                f"node {lost.node_id} could not be stopped: {state.first_stop_error}"
            )
        if state.stopping:
            raise Stopping()
        machine = lost.handle.machine_id if lost.handle is not None else None
        await self._startup.start_node(node, [machine] if machine is not None else [])
        if state.stopping:
            raise Stopping()
        self._membership.widen_watch()
        self._membership.start_lease(node, req.recovery.replacement_timeout_s)
        await self._startup.join(node, deadline)
        await self._startup.complete_bootstrap([node])
        state.replacement_joined(now_ms())
        state.next_epoch()
        ctx.view.show()
        # The replacement loads its layers while the survivors wire the new edges.
        await asyncio.gather(*(self._startup.provision_stage(n) for n in state.nodes))
        await self._startup.await_stages_ready(deadline)
        serving = state.serving_phase()
        if node.stage_index == 0:
            await self._tell_prompts(node, ready=True)  # ... which serves them now
        state.recovered(now_ms(), serving)
        rec = state.recoveries[-1]
        took = rec.seconds(rec.lost_at_ms, rec.ready_at_ms)
        if took is not None:
            metrics.sink().record_recovery(state.run_id, rec.stage_index, took * 1000)
        if not state.lost:
            ctx.view.set_phase(serving)

    async def _tell_prompts(self, head: NodeState, *, ready: bool) -> None:
        await self._prompts.tell_head(
            PromptHead(
                node_id=head.node_id,
                task_queue=head.task_queue,
                readiness_id=head.readiness_id,
                ready=ready,
            )
        )
