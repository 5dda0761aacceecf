"""Membership: each node's lease (the spec's SWIM Alive, an activity on the node's queue
that heartbeats while the node lives) and the provider watch (which names a node whose
runtime is gone). A loss is recorded in ``RunState`` and handed to ``on_loss``; what is
done about it (replace, or fault) is not decided here."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.models import LeaseInput, WatchNodesInput
    from mvp_core.run_records import NodeState
    from workflows import calls
    from workflows.prompt import failure_cause, heartbeat_lost
    from workflows.run.context import RunContext, now_ms

# A lease that failed while its node lives (a control-plane outage outlasting the lease
# heartbeat) is scheduled again; membership is lost only if no lease starts in this time.
LEASE_RECOVERY = timedelta(seconds=30)


class Membership:
    """The leases of the run's nodes and the provider watch over them."""

    def __init__(self, ctx: RunContext, on_loss: Callable[[], None]) -> None:
        self._ctx = ctx
        self._on_loss = on_loss
        self._leases: dict[int, asyncio.Task[None]] = {}
        self._watch: asyncio.Task[None] | None = None
        self._old_watches: list[asyncio.Task[None]] = []  # replaced by a wider watch
        self._watch_gen = 0  # the watch loop that is the run's (a wider one ends the others)
        self._leases_cancelled = False
        self._watch_cancelled = False

    def start_lease(self, node: NodeState, schedule_to_start_s: float) -> None:
        state, t = self._ctx.state, self._ctx.request.timeouts

        async def lease() -> None:
            # Membership is lost when the node is gone, not when the control plane
            # blinked: a lease that failed while its node lives (heartbeats that could not
            # reach the server) is scheduled again, and only a lease that no node picks
            # up in time, or one the node ends, is a loss.
            start_within = timedelta(seconds=schedule_to_start_s)
            while True:
                try:
                    await calls.lease(
                        LeaseInput(
                            run_id=state.run_id,
                            node_id=node.node_id,
                            readiness_id=node.readiness_id,
                            run_workflow_id=workflow.info().workflow_id,
                        ),
                        node.task_queue,
                        start_within,
                        t,
                        f"lease node {node.node_id} (stage {node.stage_index})",
                    )
                    detail = "lease ended"
                except asyncio.CancelledError:
                    return
                except ActivityError as err:
                    detail = failure_cause(err)
                    if heartbeat_lost(err) and not node.exited:
                        workflow.logger.warning(
                            "lease of node %s lost its heartbeat; scheduling it again",
                            node.node_id,
                        )
                        start_within = LEASE_RECOVERY
                        continue
                break
            if not self._leases_cancelled:
                state.on_lease_lost(node.node_id, detail, now_ms())
                self._on_loss()

        self._leases[node.node_id] = asyncio.ensure_future(lease())

    def drop_lease(self, node_id: int) -> None:
        """The node left the run: its lease's end is no news now."""
        lease = self._leases.pop(node_id, None)
        if lease is not None:
            lease.cancel()

    def start_watch(self) -> None:
        """Provider watch: reports each node whose runtime is gone, until none is left.

        It keeps running through teardown, so a node that dies then is skipped at once.
        """
        state = self._ctx.state
        assert state.provider_queue is not None
        queue = state.provider_queue
        self._watch_gen += 1
        gen = self._watch_gen

        async def watch() -> None:
            while gen == self._watch_gen:
                handles = [n.handle for n in state.nodes if n.handle is not None and not n.exited]
                if not handles:
                    return
                try:
                    exited = await calls.watch_nodes(
                        WatchNodesInput(handles=handles),
                        queue,
                        "watch node(s) " + ", ".join(str(h.node_id) for h in handles),
                        # The run closes only once its watch has ended (issue 21): a watch
                        # still polling after the close completes into a closed workflow.
                        wait_for_cancel=workflow.patched(names.PATCH_WATCH_ENDS_BEFORE_CLOSE),
                    )
                except (asyncio.CancelledError, ActivityError):
                    return
                if self._watch_cancelled:
                    return
                # A watch a wider one replaced may still report the exit it saw.
                state.on_node_exited(exited.node_id, exited.detail, now_ms())
                self._on_loss()

        self._watch = asyncio.ensure_future(watch())

    def widen_watch(self) -> None:
        """Watch the run's nodes as they are now (a replacement joined): the watch in
        flight ends, one over every node starts."""
        if self._watch is not None:
            self._old_watches.append(self._watch)
            self._watch.cancel()
            self._watch = None
        self.start_watch()

    async def cancel(self, *, leases: bool = True, watch: bool = True) -> None:
        """Stop leases and/or the watch on purpose: their ends are then no membership loss."""
        tasks: list[asyncio.Task[None]] = []
        if leases:
            self._leases_cancelled = True
            tasks += self._leases.values()
            self._leases = {}
        if watch and self._watch is not None:
            self._watch_cancelled = True
            tasks.append(self._watch)
            self._watch = None
        if watch:
            tasks += self._old_watches
            self._old_watches = []
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
