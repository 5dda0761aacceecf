"""Startup, from a committed plan to prompt-ready (actor spec 6.3-6.8): every node
started through its provider, each through the readiness barrier (its runtime report,
its lease, its route, its acknowledgement), each stage provisioned with its layers and
edges, and every stage ready. Stage recovery takes one replacement through the same
steps."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.generation import fixed_address_layout
    from mvp_core.models import (
        CheckRouteInput,
        CompleteBootstrapInput,
        EdgeEndpoint,
        EdgePlan,
        LifecycleKind,
        NodeLossPolicy,
        NodeProvisionSpec,
        NodeRuntimeReadyAck,
        RunPhase,
        StageProvision,
    )
    from mvp_core.planner import epoch_edges, epoch_rings
    from mvp_core.providers import fetch_allowance_s
    from mvp_core.run_records import NodeState
    from workflows import calls
    from workflows.prompt import failure_cause
    from workflows.run.context import RunContext, Stopping, slack
    from workflows.run.membership import Membership


class Startup:
    """Nodes started, joined and provisioned: the run's way to prompt-ready."""

    def __init__(self, ctx: RunContext, membership: Membership) -> None:
        self._ctx = ctx
        self._membership = membership

    async def run(self) -> None:
        """From a committed plan to prompt-ready."""
        await self._start_nodes()
        self._membership.start_watch()
        await self._readiness()
        await self._provision_stages()
        await self._await_prompt_ready()

    # ------------------------------------------------------------------ nodes
    async def _start_nodes(self) -> None:
        ctx, state = self._ctx, self._ctx.state
        if not state.may_provision():
            raise Stopping()
        ctx.view.set_phase(RunPhase.PROVISIONING)
        state.record(LifecycleKind.RUN_PROVISIONING_STARTED)
        if ctx.traits.rented_hosts:
            # Every start runs to its end before a failure propagates: teardown must
            # know each instance that a start still in flight would have created.
            results = await asyncio.gather(
                *(self.start_node(n) for n in state.nodes), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            if state.stopping:
                raise Stopping()
        else:
            for node in state.nodes:
                await self.start_node(node)
                if state.stopping:
                    raise Stopping()

    async def start_node(self, node: NodeState, avoid_machines: Sequence[int] = ()) -> None:
        """The provider start of ``node`` (its handle recorded once it reports back)."""
        state, req, traits = self._ctx.state, self._ctx.request, self._ctx.traits
        assert state.plan is not None and state.provider_queue is not None
        host_nodes = traits.host_nodes(len(state.nodes))
        stages = state.plan.stages
        need = stages[node.stage_index].memory_need if node.stage_index < len(stages) else None
        spec = NodeProvisionSpec(
            run_id=state.run_id,
            node_id=node.node_id,
            stage_index=node.stage_index,
            nonce=state.nonce,
            task_queue=node.task_queue,
            readiness_id=node.readiness_id,
            authorized_orchestrator=state.authorized_orchestrator,
            run_workflow_id=workflow.info().workflow_id,
            image_or_artifact=req.worker_image,
            # Local providers put every node on this host: nodes share its cores. A
            # rented instance is a host of its own.
            environment={
                **req.node_env,
                "MVP_HOST_NODES": str(host_nodes),
                "MVP_ADDRESS_LAYOUT": "fixed"
                if fixed_address_layout(req.engine.address_layout, host_nodes)
                else "randomized",
            },
            coordinator_endpoint="",
            temporal_namespace=workflow.info().namespace,
            provider=req.provider,
            gpus=traits.gpus(req),
            cpus=traits.cpus(req),
            memory=traits.stage_memory(req, need),
            memory_need=need,
            mounts=sorted(set(state.plan.files())),
            model_share=state.plan.share_of(node.stage_index),
            vastai=traits.vastai(req),
            avoid_machines=list(avoid_machines),
        )
        # Neither abandoned on shutdown nor cancelled with the workflow: a start in
        # flight may launch its node, which teardown must then know about to stop it.
        node.start_attempted = True
        start = asyncio.ensure_future(
            calls.start_node(
                spec,
                state.provider_queue,
                traits.start_timeout_s(req) + fetch_allowance_s(spec.model_share),
                f"start node {node.node_id} (stage {node.stage_index})",
            )
        )
        try:
            node.handle = await asyncio.shield(start)
        except asyncio.CancelledError:
            node.handle = await start
            raise

    # ------------------------------------------------------------------ readiness
    async def _readiness(self) -> None:
        """Each node: its runtime report, its lease, its route, its acknowledgement."""
        ctx, state, req = self._ctx, self._ctx.state, self._ctx.request
        ctx.view.set_phase(RunPhase.READINESS)
        state.record(LifecycleKind.RUN_READINESS_STARTED)
        deadline = workflow.now() + timedelta(seconds=req.timeouts.readiness_s)
        for node in state.nodes:
            self._membership.start_lease(node, req.timeouts.readiness_s)
        for node in state.nodes:
            await self.join(node, deadline)
        await self.complete_bootstrap(state.nodes)

    async def complete_bootstrap(self, nodes: Sequence[NodeState]) -> None:
        """Process spec 7.6: once every node is acknowledged, its provider completes its
        bootstrap (a rented node's environment file, its secrets, removed from its disk).
        What a provider could not do is logged (and is its node's provider log line in
        the datastream); the node serves all the same."""
        handles = [n.handle for n in nodes if n.handle is not None]
        if not handles or not workflow.patched(names.PATCH_COMPLETE_BOOTSTRAP):
            return
        assert self._ctx.state.provider_queue is not None
        ids = ", ".join(str(h.node_id) for h in handles)
        try:
            result = await calls.complete_bootstrap(
                CompleteBootstrapInput(handles=handles),
                self._ctx.state.provider_queue,
                f"complete bootstrap of node(s) {ids}",
            )
            errors = result.errors
        except ActivityError as err:
            errors = [failure_cause(err)]
        for error in errors:
            workflow.logger.warning("complete_bootstrap: %s", error)

    async def join(self, node: NodeState, deadline: datetime) -> None:
        """The node's readiness barrier: its runtime report, its lease, its route, its ack."""
        await self._ctx.wait(
            lambda: node.runtime_ready is not None,
            deadline,
            f"node {node.node_id} did not report NodeRuntimeReady",
        )
        await self._ctx.wait(
            lambda: node.lease_started,
            deadline,
            f"node {node.node_id} lease never started (membership)",
        )
        await self._check_route(node, deadline)
        await self._ack(node)

    async def _check_route(self, node: NodeState, deadline: datetime) -> None:
        assert node.runtime_ready is not None
        remaining = max((deadline - workflow.now()).total_seconds(), 1.0)
        check = await self._ctx.guard(
            calls.check_route(
                CheckRouteInput(
                    task_queue=node.task_queue, identity=node.runtime_ready.worker_identity
                ),
                remaining,
                f"check route of node {node.node_id} (stage {node.stage_index})",
            )
        )
        self._ctx.state.on_route_checked(node.node_id, check.owned, check.reason)
        if not check.owned:
            raise RuntimeError(
                f"route owner of {node.task_queue} does not match node {node.node_id}: "
                f"{check.reason}"
            )

    async def _ack(self, node: NodeState) -> None:
        ack = await self._ctx.guard(
            calls.ack_runtime_ready(
                NodeRuntimeReadyAck(
                    run_id=self._ctx.state.run_id,
                    node_id=node.node_id,
                    stage_index=node.stage_index,
                    readiness_id=node.readiness_id,
                ),
                node.task_queue,
                self._ctx.request.timeouts,
                f"ack runtime-ready of node {node.node_id} (stage {node.stage_index})",
            )
        )
        if not self._ctx.state.on_ack(ack):
            raise RuntimeError(
                f"runtime-ready acknowledgement of node {node.node_id} did not match"
            )

    # ------------------------------------------------------------------ stages
    async def _provision_stages(self) -> None:
        self._ctx.view.set_phase(RunPhase.STAGE_PROVISIONING)
        # Weights load one stage after another (actor spec 6.7); edges connect meanwhile.
        for node in sorted(self._ctx.state.nodes, key=lambda n: n.stage_index):
            await self.provision_stage(node)

    async def provision_stage(self, node: NodeState) -> None:
        """StageProvision to ``node`` for the run's current pipeline, then its WeightsReady."""
        state, req = self._ctx.state, self._ctx.request
        assert state.plan is not None
        stage = state.plan.stages[node.stage_index]
        replace = req.on_node_loss is NodeLossPolicy.REPLACE
        provision = StageProvision(
            run_id=state.run_id,
            authorized_orchestrator=state.authorized_orchestrator,
            node_id=node.node_id,
            stage_index=node.stage_index,
            stage_count=state.plan.stage_count,
            layers=stage.layers,
            inbound_edge=self._edge(dst=node.stage_index),
            outbound_edge=self._edge(src=node.stage_index),
            consumer_endpoint=self._consumer(node.stage_index),
            driver_edges=[
                e
                for e in epoch_edges(state.plan.edges, state.epoch)
                if node.stage_index == 0 and (e.src_stage is None or e.dst_stage is None)
            ],
            model_name=state.plan.model_facts.name,
            model_path=state.plan.model_path,
            tokenizer_path=state.plan.tokenizer_path,
            max_seq_len=state.plan.max_seq_len,
            max_active_prompts=req.max_active_prompts,
            rings=epoch_rings(state.plan.rings, state.epoch),
            readiness_id=node.readiness_id,
            engine=req.engine,
            run_workflow_id=workflow.info().workflow_id,
            epoch=state.epoch,
            recovery_wait_s=slack(req.recovery.replacement_timeout_s)
            if replace and node.stage_index == 0
            else None,
        )
        node.stage_provisioned = True
        await self._ctx.guard(
            calls.provision_stage(
                provision,
                node.task_queue,
                req.timeouts,
                f"provision stage {node.stage_index} of {state.plan.stage_count} "
                f"on node {node.node_id}",
            )
        )
        deadline = workflow.now() + timedelta(seconds=req.timeouts.ack_s)
        await self._ctx.wait(
            lambda: node.weights_ready,
            deadline,
            f"stage {node.stage_index} did not report WeightsReady",
        )

    def _edge(self, *, src: int | None = None, dst: int | None = None) -> EdgePlan | None:
        """The stage's outbound (src) or inbound (dst) edge of the committed plan."""
        state = self._ctx.state
        assert state.plan is not None
        for edge in epoch_edges(state.plan.edges, state.epoch):
            if src is not None and edge.src_stage == src:
                return edge
            if dst is not None and edge.dst_stage == dst:
                return edge
        return None

    def _consumer(self, stage_index: int) -> EdgeEndpoint | None:
        """Where stage ``stage_index`` sends: the next stage, or the head's driver."""
        edge = self._edge(src=stage_index)
        if edge is None:
            return None
        target = edge.dst_stage if edge.dst_stage is not None else 0
        node = next(n for n in self._ctx.state.nodes if n.stage_index == target)
        assert node.runtime_ready is not None
        host, _, port = node.runtime_ready.endpoint.rpartition(":")
        return EdgeEndpoint(edge_id=edge.edge_id, host=host, port=int(port))

    # ------------------------------------------------------------------ prompt-ready
    async def _await_prompt_ready(self) -> None:
        deadline = workflow.now() + timedelta(seconds=self._ctx.request.timeouts.readiness_s)
        await self.await_stages_ready(deadline)
        self._ctx.view.set_phase(RunPhase.PROMPT_READY)
        self._ctx.state.record(LifecycleKind.RUN_READY)

    async def await_stages_ready(self, deadline: datetime) -> None:
        """Every stage ready on the run's pipeline, and the head's token endpoints."""
        ctx, state = self._ctx, self._ctx.state
        for node in state.nodes:
            await ctx.wait(
                lambda n=node: n.stage_ready,  # type: ignore[misc]
                deadline,
                f"stage {node.stage_index} did not report StageReady (edges)",
            )
        if state.uses_token_endpoints:
            await ctx.wait(
                lambda: state.token_endpoints_ready,
                deadline,
                "the head node's token endpoints did not become ready",
            )
        if not state.prompt_ready_allowed():
            raise Stopping() if state.stopping else RuntimeError("prompt-ready facts incomplete")
