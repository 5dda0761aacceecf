"""RunWorkflow: the run authority of the actor spec, wired to Temporal.

Thin by design: every decision is a method of the pure ``RunState``; this module turns
those decisions into activities, signals, child workflows and timers. Teardown runs on
every exit path except continue-as-new, which carries the state to the next run.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from temporalio import workflow
from temporalio.common import RawValue, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from mvp_core import metrics, names
    from mvp_core.errors import ErrorType
    from mvp_core.generation import effective_max_tokens, fixed_address_layout
    from mvp_core.inputs import InvalidInput, NotJson, decode_one
    from mvp_core.models import (
        CancelPrompt,
        CheckRouteInput,
        DatastreamAddress,
        EdgeEndpoint,
        EdgePlan,
        Fault,
        LeaseInput,
        LeaseStarted,
        LifecycleKind,
        NodeExited,
        NodeHandle,
        NodeLossPolicy,
        NodeProvisionSpec,
        NodeRuntimeReady,
        NodeRuntimeReadyAck,
        PreparePlanInput,
        PromptHead,
        PromptHost,
        PromptInput,
        PromptOutcome,
        PromptStatus,
        PromptTerminal,
        RequestShutdown,
        RouteCheck,
        RunDatastreamInput,
        RunOutcome,
        RunPhase,
        RunPlan,
        RunRequest,
        ServedPrompt,
        ShutdownReason,
        StageFault,
        StageProvision,
        StageReady,
        StageStopped,
        StopNodeInput,
        StopNodeResult,
        StopRun,
        SubmitPrompt,
        TokenEndpointsReady,
        WatchNodesInput,
        WeightsReady,
    )
    from mvp_core.planner import epoch_edges, epoch_rings
    from mvp_core.providers import traits
    from mvp_core.run_state import (
        NODE_CONDITIONS,
        NodeState,
        PromptRecord,
        PromptRejection,
        RunState,
        prompt_limit,
    )
    from mvp_core.validation import (
        RunRejectedError,
        describe_invalid,
        parse_request,
        resolve_run_id,
        validate_request,
    )
    from workflows import calls
    from workflows.prompt import (
        PromptServing,
        PromptWorkflow,
        failure_cause,
        heartbeat_lost,
        retrieve,
    )

PHASE_KEY = SearchAttributeKey.for_keyword(names.SEARCH_ATTRIBUTE_PHASE)
HANDLERS_DRAIN = timedelta(seconds=30)
WORKFLOW_TASK_TIMEOUT = timedelta(seconds=names.WORKFLOW_TASK_TIMEOUT_S)
# A survivor's fault report (an edge its dead peer closed) waits this long for the
# provider watch (0.5 s polls) to name the node that died: the first fault names it.
CULPRIT_GRACE = timedelta(seconds=2)
# ... and longer where the run replaces lost nodes (DECISIONS 68): a rented instance's
# status is polled every 5 s, and a loss the watch names is replaced, not fatal.
REPLACE_CULPRIT_GRACE = timedelta(seconds=10)
# A prompt (and the head holding one) waits this much longer than the run's bound on a
# recovery: the run, not a prompt, decides that a recovery failed (it then tears down).
RECOVERY_SLACK_S = 60.0
# A lease that failed while its node lives (a control-plane outage outlasting the lease
# heartbeat) is scheduled again; membership is lost only if no lease starts in this time.
LEASE_RECOVERY = timedelta(seconds=30)
PROMPT_DRAIN_S = 5.0  # beyond a generate's heartbeat timeout, for its prompt to end
# A run-hosted prompt's end is kept for re-attach and the dashboard (DECISIONS 66): the
# latest this many, their texts this many characters in all (they are carried across
# continue-as-new: one payload, under the server's 512 KB warning even at 4 bytes a
# character), the latest one always.
SERVED_KEPT = 32
SERVED_TEXT_KEPT = 96 * 1024


class RunCarry(BaseModel):
    """What continue-as-new hands to the next run of the same workflow id."""

    model_config = ConfigDict(extra="forbid")
    request: RunRequest
    state: RunState
    served: list[ServedPrompt] = Field(default_factory=list)  # run-hosted prompts' ends


_CARRY_KEYS = frozenset(RunCarry.model_fields)


def _decode_start(start: RawValue) -> RunRequest | RunCarry:
    """The run's start input: the RunCarry of continue-as-new, or a RunRequest validated
    field by field (RunRejectedError names what is wrong)."""
    try:
        raw = workflow.payload_converter().from_payload(start.payload)
    except Exception:
        raise RunRejectedError("invalid run request: the input is not JSON") from None
    if not (isinstance(raw, dict) and {"request", "state"} <= raw.keys() <= _CARRY_KEYS):
        return parse_request(raw)
    try:
        return RunCarry.model_validate(raw)
    except ValidationError as err:
        raise RunRejectedError(f"invalid run carry: {describe_invalid(err)}") from None


class _Stopping(Exception):
    """Internal: the run started stopping while a startup step was waiting."""


class _Rejected(Exception):
    """Internal: planning rejected the run; nothing was provisioned."""


@workflow.defn(name=names.RUN_WORKFLOW, failure_exception_types=[Exception])
class RunWorkflow:
    @workflow.init
    def __init__(self, start: RawValue) -> None:
        # The input arrives raw (a RunRequest from a client or the CLI, or the RunCarry of
        # continue-as-new) so that a malformed request is rejected, naming its bad fields,
        # instead of failing every workflow task while the SDK decodes it.
        self._rejection: str | None = None
        decoded: RunRequest | RunCarry
        try:
            decoded = _decode_start(start)
        except RunRejectedError as err:
            decoded, self._rejection = RunRequest(), str(err)
        carry = decoded if isinstance(decoded, RunCarry) else None
        request = decoded.request if isinstance(decoded, RunCarry) else decoded
        self._carry = carry
        self._request = request
        self._traits = traits(request.provider)
        self._children: dict[str, Any] = {}  # prompt workflows open
        self._hosted: dict[str, PromptServing] = {}  # run-hosted prompts open (DECISIONS 66)
        self._served: OrderedDict[str, ServedPrompt] = OrderedDict()  # ... that ended
        self._leases: dict[int, asyncio.Task[None]] = {}
        self._watch: asyncio.Task[None] | None = None
        self._old_watches: list[asyncio.Task[None]] = []  # replaced by a wider watch
        self._watch_gen = 0  # the watch loop that is the run's (a wider one ends the others)
        self._recovery: asyncio.Task[None] | None = None  # replacing lost nodes
        self._datastream: asyncio.Task[None] | None = None
        self._closing = False  # torn down and every background activity ended: returns next
        self._busy_handlers = 0  # prompt Updates and signal handlers in flight
        self._started_children: set[str] = set()  # prompt workflows started (this run)
        self._early_cancels: dict[str, str] = {}  # cancels that came before their start
        self._rolling_over = False
        self._ready_seen = False  # time to prompt-ready recorded
        self._background_cancelled = False
        self._watch_cancelled = False
        self._grace: asyncio.Task[None] | None = None
        if carry is not None:
            self._state = carry.state
            self._served = OrderedDict((p.workflow_id, p) for p in carry.served[-SERVED_KEPT:])
            self._state.continued += 1
            # Serving resumes at once; leases restart in run() (DECISIONS 13).
            self._state.phase = RunPhase.PROMPT_READY
            return
        run_id = -1
        try:
            run_id = resolve_run_id(request, workflow.info().workflow_id)
            if self._rejection is None:
                validate_request(request)
        except RunRejectedError as err:
            self._rejection = self._rejection or str(err)
        nonce = workflow.uuid4().hex
        self._state = RunState(
            run_id=run_id if run_id >= 0 else (request.run_id or 0),
            nonce=nonce,
            authorized_orchestrator=f"{workflow.info().workflow_id}/{nonce[:8]}",
            prompt_host=request.prompt_host,
            node_loss=request.on_node_loss,
            recovery_bound=request.recovery,
        )

    # ------------------------------------------------------------------ run
    @workflow.run
    async def run(self, start: RawValue) -> RunOutcome:
        """Run from a RunRequest, or resume from what continue-as-new carried."""
        state = self._state
        carry = self._carry
        if carry is None:
            if self._rejection is not None:
                return self._reject(self._rejection)
            state.record(LifecycleKind.RUN_ACCEPTED)
            self._set_phase(RunPhase.ACCEPTED)
        action = "stop"
        try:
            if carry is None:
                await self._plan()
                await self._startup()
            else:
                self._resume()
            action = await self._serve()
        except _Rejected as rejected:
            await self._stop_datastream()
            return self._reject(str(rejected))  # planning provisioned nothing: no teardown
        except _Stopping:
            pass
        except asyncio.CancelledError:
            state.request_shutdown(ShutdownReason.HOST_REQUESTED)
        except Exception as err:
            state.fault(f"{state.phase_word()}: {_describe(err)}")
        await self._stop_recovery()
        if action == "continue_as_new":
            await self._cancel_background()
            await self._stop_datastream()  # the continued run starts its own
            workflow.continue_as_new(
                RunCarry(request=self._request, state=state, served=list(self._served.values())),
                task_timeout=WORKFLOW_TASK_TIMEOUT,
            )
        await asyncio.shield(asyncio.ensure_future(self._teardown()))
        await self._stop_datastream()  # after RunTornDown: it publishes it, then closes
        self._closing = True
        outcome = state.outcome()
        if state.first_fault is not None:
            raise ApplicationError(
                state.first_fault, outcome, type=ErrorType.RUN_FAULTED, non_retryable=True
            )
        if state.provider_stop_error is not None:
            # Operator stop, but a node may still run (process spec 10.13).
            raise ApplicationError(
                f"operator stop: {state.provider_stop_error}",
                outcome,
                type=ErrorType.RUN_STOP_FAILED,
                non_retryable=True,
            )
        return outcome

    def _reject(self, reason: str) -> RunOutcome:
        """RunRejected: the workflow fails with the reason; nothing was provisioned."""
        state = self._state
        state.phase = RunPhase.REJECTED
        state.record(LifecycleKind.RUN_REJECTED, reason)
        self._set_phase(RunPhase.REJECTED)
        raise ApplicationError(
            reason, state.outcome(), type=ErrorType.RUN_REJECTED, non_retryable=True
        )

    # ------------------------------------------------------------------ planning
    async def _plan(self) -> None:
        """Commit a plan, or raise _Rejected (a planning failure is a rejection, actor
        spec 6.2); a shutdown while planning stops the run at once."""
        state, req = self._state, self._request
        self._set_phase(RunPhase.PLANNING)
        state.record(LifecycleKind.RUN_PLANNING_STARTED)
        try:
            state.provider_queue = await self._guard(
                calls.provider_queue(f"provider queue of run {state.run_id} ({req.provider.value})")
            )
            self._start_datastream()
            plan: RunPlan = await self._guard(
                calls.prepare_plan(
                    PreparePlanInput(
                        run_id=state.run_id,
                        orchestrator_node_id=req.orchestrator_node_id,
                        node_id=req.node_id,
                        model=req.model,
                        tokenizer=req.tokenizer,
                        pipeline_stages=req.pipeline_stages,
                        max_context=req.max_context,
                        activation_dtype=req.activation_dtype,
                        layer_split=req.layer_split,
                        provider=req.provider,
                        gpus=self._traits.gpus(req),
                        vastai=self._traits.vastai(req),
                    ),
                    state.provider_queue,
                    f"plan {self._model_name()} in {req.pipeline_stages} stage(s)",
                )
            )
        except ActivityError as err:
            raise _Rejected(f"planning failed: {failure_cause(err)}") from None
        state.plan = plan
        self._show()
        for stage in plan.stages:
            state.nodes.append(
                NodeState(
                    node_id=stage.node_id,
                    stage_index=stage.stage_index,
                    task_queue=names.node_task_queue(state.run_id, stage.node_id, state.nonce),
                    readiness_id=f"{state.nonce[:8]}-{stage.node_id}-{stage.stage_index}",
                )
            )
        state.record(
            LifecycleKind.RUN_PLANNING_READY,
            f"{plan.stage_count} stage(s) of {plan.model_facts.name}, max_seq_len {plan.max_seq_len}",
        )

    # ------------------------------------------------------------------ startup
    async def _startup(self) -> None:
        """From a committed plan to prompt-ready: every node started, through the
        readiness barrier, its stage provisioned and ready (actor spec 6.3-6.8)."""
        await self._start_nodes()
        self._start_watch()
        await self._readiness()
        await self._provision_stages()
        await self._await_prompt_ready()

    async def _start_nodes(self) -> None:
        state = self._state
        if not state.may_provision():
            raise _Stopping()
        self._set_phase(RunPhase.PROVISIONING)
        state.record(LifecycleKind.RUN_PROVISIONING_STARTED)
        if self._traits.rented_hosts:
            # Every start runs to its end before a failure propagates: teardown must
            # know each instance that a start still in flight would have created.
            results = await asyncio.gather(
                *(self._start_node(n) for n in state.nodes), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            if state.stopping:
                raise _Stopping()
        else:
            for node in state.nodes:
                await self._start_node(node)
                if state.stopping:
                    raise _Stopping()

    async def _start_node(self, node: NodeState, avoid_machines: Sequence[int] = ()) -> None:
        state, req, traits = self._state, self._request, self._traits
        assert state.plan is not None and state.provider_queue is not None
        host_nodes = traits.host_nodes(len(state.nodes))
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
            mounts=sorted({state.plan.model_path, state.plan.tokenizer_path}),
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
                traits.start_timeout_s(req),
                f"start node {node.node_id} (stage {node.stage_index})",
            )
        )
        try:
            node.handle = await asyncio.shield(start)
        except asyncio.CancelledError:
            node.handle = await start
            raise

    async def _readiness(self) -> None:
        """Each node: its runtime report, its lease, its route, its acknowledgement."""
        state, req = self._state, self._request
        self._set_phase(RunPhase.READINESS)
        state.record(LifecycleKind.RUN_READINESS_STARTED)
        deadline = workflow.now() + timedelta(seconds=req.timeouts.readiness_s)
        for node in state.nodes:
            self._start_lease(node, req.timeouts.readiness_s)
        for node in state.nodes:
            await self._join(node, deadline)

    async def _join(self, node: NodeState, deadline: datetime) -> None:
        """The node's readiness barrier: its runtime report, its lease, its route, its ack."""
        await self._wait(
            lambda: node.runtime_ready is not None,
            deadline,
            f"node {node.node_id} did not report NodeRuntimeReady",
        )
        await self._wait(
            lambda: node.lease_started,
            deadline,
            f"node {node.node_id} lease never started (membership)",
        )
        await self._check_route(node, deadline)
        await self._ack(node)

    async def _provision_stages(self) -> None:
        self._set_phase(RunPhase.STAGE_PROVISIONING)
        # Weights load one stage after another (actor spec 6.7); edges connect meanwhile.
        for node in sorted(self._state.nodes, key=lambda n: n.stage_index):
            await self._provision_stage(node)

    async def _await_prompt_ready(self) -> None:
        deadline = workflow.now() + timedelta(seconds=self._request.timeouts.readiness_s)
        await self._await_stages_ready(deadline)
        self._set_phase(RunPhase.PROMPT_READY)
        self._state.record(LifecycleKind.RUN_READY)

    async def _await_stages_ready(self, deadline: datetime) -> None:
        """Every stage ready on the run's pipeline, and the head's token endpoints."""
        state = self._state
        for node in state.nodes:
            await self._wait(
                lambda n=node: n.stage_ready,
                deadline,
                f"stage {node.stage_index} did not report StageReady (edges)",
            )
        if state.uses_token_endpoints:
            await self._wait(
                lambda: state.token_endpoints_ready,
                deadline,
                "the head node's token endpoints did not become ready",
            )
        if not state.prompt_ready_allowed():
            raise _Stopping() if state.stopping else RuntimeError("prompt-ready facts incomplete")

    async def _check_route(self, node: NodeState, deadline: datetime) -> None:
        assert node.runtime_ready is not None
        remaining = max((deadline - workflow.now()).total_seconds(), 1.0)
        check: RouteCheck = await self._guard(
            calls.check_route(
                CheckRouteInput(
                    task_queue=node.task_queue, identity=node.runtime_ready.worker_identity
                ),
                remaining,
                f"check route of node {node.node_id} (stage {node.stage_index})",
            )
        )
        self._state.on_route_checked(node.node_id, check.owned)
        if not check.owned:
            raise RuntimeError(
                f"route owner of {node.task_queue} does not match node {node.node_id}: "
                f"{check.reason}"
            )

    async def _ack(self, node: NodeState) -> None:
        ack = await self._guard(
            calls.ack_runtime_ready(
                NodeRuntimeReadyAck(
                    run_id=self._state.run_id,
                    node_id=node.node_id,
                    stage_index=node.stage_index,
                    readiness_id=node.readiness_id,
                ),
                node.task_queue,
                self._request.timeouts,
                f"ack runtime-ready of node {node.node_id} (stage {node.stage_index})",
            )
        )
        if not self._state.on_ack(ack):
            raise RuntimeError(
                f"runtime-ready acknowledgement of node {node.node_id} did not match"
            )

    async def _provision_stage(self, node: NodeState) -> None:
        state, req = self._state, self._request
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
            recovery_wait_s=_slack(req.recovery.replacement_timeout_s)
            if replace and node.stage_index == 0
            else None,
        )
        node.stage_provisioned = True
        await self._guard(
            calls.provision_stage(
                provision,
                node.task_queue,
                req.timeouts,
                f"provision stage {node.stage_index} of {state.plan.stage_count} "
                f"on node {node.node_id}",
            )
        )
        deadline = workflow.now() + timedelta(seconds=req.timeouts.ack_s)
        await self._wait(
            lambda: node.weights_ready,
            deadline,
            f"stage {node.stage_index} did not report WeightsReady",
        )

    def _edge(self, *, src: int | None = None, dst: int | None = None) -> EdgePlan | None:
        """The stage's outbound (src) or inbound (dst) edge of the committed plan."""
        assert self._state.plan is not None
        for edge in epoch_edges(self._state.plan.edges, self._state.epoch):
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
        node = next(n for n in self._state.nodes if n.stage_index == target)
        assert node.runtime_ready is not None
        host, _, port = node.runtime_ready.endpoint.rpartition(":")
        return EdgeEndpoint(edge_id=edge.edge_id, host=host, port=int(port))

    # ------------------------------------------------------------------ background
    def _start_lease(self, node: NodeState, schedule_to_start_s: float) -> None:
        state, t = self._state, self._request.timeouts

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
            if not self._background_cancelled:
                state.on_lease_lost(node.node_id, detail, _now_ms())
                self._recover_lost()

        self._leases[node.node_id] = asyncio.ensure_future(lease())

    def _start_watch(self) -> None:
        """Provider watch: reports each node whose runtime is gone, until none is left.

        It keeps running through teardown, so a node that dies then is skipped at once.
        """
        state = self._state
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
                    exited: NodeExited = await calls.watch_nodes(
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
                state.on_node_exited(exited.node_id, exited.detail, _now_ms())
                self._recover_lost()

        self._watch = asyncio.ensure_future(watch())

    def _widen_watch(self) -> None:
        """Watch the run's nodes as they are now (a replacement joined): the watch in
        flight ends, one over every node starts."""
        if self._watch is not None:
            self._old_watches.append(self._watch)
            self._watch.cancel()
            self._watch = None
        self._start_watch()

    # ------------------------------------------------------------------ stage recovery
    def _recover_lost(self) -> None:
        """Replace the nodes the run has lost (DECISIONS 68), one after another."""
        if self._state.lost and self._recovery is None and not self._state.stopping:
            self._recovery = asyncio.ensure_future(self._recover())

    async def _recover(self) -> None:
        state = self._state
        self._set_phase(RunPhase.RECOVERING)
        try:
            while state.lost and not state.stopping:
                await self._replace()
        except _Stopping:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as err:
            rec = state.recovering
            stage = f"stage {rec.stage_index}" if rec is not None else "a stage"
            state.fault(f"prompt serving: recovery of {stage} failed: {_describe(err)}")
        finally:
            self._recovery = None

    async def _replace(self) -> None:
        """Stop what is left of the lost node, start its replacement through the same
        provider, take it through the readiness barrier, wire every stage into a new
        pipeline (the survivors keep their weights) and return to prompt-ready. The head
        node holds its prompts in flight meanwhile and continues them on the new pipeline."""
        state, req = self._state, self._request
        lost_at = state.lost[0].lost_at_ms
        lost, node = state.begin_replacement(_now_ms())
        self._show()
        # The bound runs from the loss, as the prompts' and the head's own waits do.
        deadline = workflow.now() + timedelta(
            seconds=req.recovery.replacement_timeout_s - (_now_ms() - lost_at) / 1000
        )
        if node.stage_index == 0:
            await self._tell_prompts(node, ready=False)  # they wait for the new head
        lease = self._leases.pop(lost.node_id, None)
        if lease is not None:
            lease.cancel()  # its end is no news now: the node is out of the run
        if not await self._stop_node(lost):  # a rental is destroyed, never left billing
            lost.provider_stopped = False  # teardown tries again
            raise RuntimeError(
                f"node {lost.node_id} could not be stopped: {state.first_stop_error}"
            )
        if state.stopping:
            raise _Stopping()
        machine = lost.handle.machine_id if lost.handle is not None else None
        await self._start_node(node, [machine] if machine is not None else [])
        if state.stopping:
            raise _Stopping()
        self._widen_watch()
        self._start_lease(node, req.recovery.replacement_timeout_s)
        await self._join(node, deadline)
        state.replacement_joined(_now_ms())
        state.next_epoch()
        self._show()
        # The replacement loads its layers while the survivors wire the new edges.
        await asyncio.gather(*(self._provision_stage(n) for n in state.nodes))
        await self._await_stages_ready(deadline)
        serving = RunPhase.ROLLING_OVER if self._rolling_over else RunPhase.PROMPT_READY
        if node.stage_index == 0:
            await self._tell_prompts(node, ready=True)  # ... which serves them now
        state.recovered(_now_ms(), serving)
        rec = state.recoveries[-1]
        took = rec.seconds(rec.lost_at_ms, rec.ready_at_ms)
        if took is not None:
            metrics.sink().record_recovery(state.run_id, rec.stage_index, took * 1000)
        if not state.lost:
            self._set_phase(serving)

    def _head_news(self, inp: PromptInput) -> PromptHead | None:
        """What a prompt admitted with ``inp`` has not heard of its head: that it is being
        replaced, or which node serves instead (None: nothing)."""
        state = self._state
        rec = state.recovering
        head = state.head()
        replacing = rec is not None and rec.stage_index == 0
        if not replacing and head.task_queue == inp.head_task_queue:
            return None
        return PromptHead(
            node_id=head.node_id,
            task_queue=head.task_queue,
            readiness_id=head.readiness_id,
            ready=not replacing,
        )

    async def _tell_prompts(self, head: NodeState, *, ready: bool) -> None:
        """Every open prompt learns that the head node is lost, or which node serves it
        now: one generating goes on there from its last checkpoint, one waiting goes there."""
        news = PromptHead(
            node_id=head.node_id,
            task_queue=head.task_queue,
            readiness_id=head.readiness_id,
            ready=ready,
        )
        for serving in self._hosted.values():
            serving.move_head(news)
        for wf_id, child in list(self._children.items()):
            if child.done():
                continue
            try:
                await child.signal(names.SIGNAL_PROMPT_HEAD, news)
            except Exception:
                workflow.logger.info("head news to %s not delivered", wf_id)

    async def _stop_recovery(self) -> None:
        """The run ends: a replacement in flight stops where it is (a start in flight
        runs to its end, so that teardown knows the node it may have launched)."""
        task = self._recovery
        if task is None:
            return
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, _Stopping):
            pass

    def _start_datastream(self) -> None:
        """The run's datastream activity (DECISIONS 58), on the provider queue beside the
        provider activities; recorded histories without it replay without it."""
        state = self._state
        if (
            self._datastream is not None
            or state.provider_queue is None
            or not workflow.patched(names.PATCH_RUN_DATASTREAM)
        ):
            return
        inp = RunDatastreamInput(
            run_id=state.run_id,
            run_workflow_id=workflow.info().workflow_id,
            provider=self._request.provider,
            nonce=state.nonce,
        )
        self._datastream = asyncio.ensure_future(calls.run_datastream(inp, state.provider_queue))

    async def _stop_datastream(self) -> None:
        """Cancel the datastream and wait until it has published its last records."""
        task, self._datastream = self._datastream, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, ActivityError):
            pass

    async def _cancel_background(self, *, leases: bool = True, watch: bool = True) -> None:
        """Stop leases and/or the watch on purpose: their ends are then no membership loss."""
        tasks: list[asyncio.Task[None]] = []
        if leases:
            self._background_cancelled = True
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

    # ------------------------------------------------------------------ waiting helpers
    async def _wait(self, cond: Any, deadline: Any, what: str) -> None:
        state = self._state
        remaining = (deadline - workflow.now()).total_seconds()
        try:
            await workflow.wait_condition(
                lambda: cond() or state.stopping, timeout=max(remaining, 0.001)
            )
        except TimeoutError:
            raise RuntimeError(f"{what} in time") from None
        if state.stopping:
            raise _Stopping()

    async def _guard(self, awaitable: Any) -> Any:
        """Await an activity, but give up on it as soon as the run starts stopping."""
        task = asyncio.ensure_future(awaitable)
        await workflow.wait_condition(lambda: task.done() or self._state.stopping)
        if not task.done():
            _abandon(task)
            raise _Stopping()
        return task.result()

    # ------------------------------------------------------------------ serving
    def _resume(self) -> None:
        """After continue-as-new: leases, the watch and the datastream start again at once."""
        state = self._state
        if state.lost or state.recovering is not None:
            # Never carried (a run does not continue as new while it recovers): a carry
            # that has one cannot be finished here.
            state.fault("prompt serving: a stage recovery was cut off by continue-as-new")
        self._start_datastream()
        for node in self._state.nodes:
            self._start_lease(node, self._request.timeouts.lease_heartbeat_s * 3)
        self._start_watch()
        if self._state.suspected_fault is not None:
            self._start_grace()  # its timer did not cross continue-as-new
        self._set_phase(RunPhase.PROMPT_READY)

    async def _serve(self) -> str:
        state = self._state
        while True:
            await workflow.wait_condition(
                lambda: (
                    state.stopping
                    or state.may_activate(self._request.max_active_prompts)
                    or (self._roll_over_now() and not self._rolling_over)
                    or (self._rolling_over and self._rolled_over())
                )
            )
            if state.stopping:
                return "stop"
            if self._rolling_over and self._rolled_over():
                await workflow.wait_condition(
                    lambda: workflow.all_handlers_finished() or state.stopping
                )
                if state.stopping:
                    return "stop"
                if self._recovering():
                    continue  # a node was lost meanwhile: its recovery first
                return "continue_as_new"
            if self._roll_over_now() and not self._rolling_over:
                self._rolling_over = True
                self._set_phase(RunPhase.ROLLING_OVER)
                continue
            while state.activate_next(self._request.max_active_prompts) is not None:
                pass
            self._show()

    def _recovering(self) -> bool:
        return bool(self._state.lost) or self._state.recovering is not None

    def _roll_over_now(self) -> bool:
        """Time to continue as new (the server suggests it), unless a stage is being
        replaced: the recovery finishes first."""
        return workflow.info().is_continue_as_new_suggested() and not self._recovering()

    def _rolled_over(self) -> bool:
        return self._state.prompts_in_flight() == 0 and not self._recovering()

    @workflow.update(name=names.UPDATE_SUBMIT_PROMPT)
    async def submit_prompt(self, *args: Any) -> PromptTerminal:
        self._busy_handlers += 1
        try:
            return await self._serve_prompt(args)
        finally:
            self._busy_handlers -= 1

    async def _serve_prompt(self, args: Sequence[Any]) -> PromptTerminal:
        """Admit the prompt, serve it in its turn (its PromptWorkflow, or this run itself:
        DECISIONS 66), and return its one terminal event."""
        state = self._state
        prompt = self._prompt_of(args)
        if (
            self._request.on_node_loss is NodeLossPolicy.REPLACE
            and prompt.temperature > 0
            and prompt.seed is None
        ):
            # Its seed is drawn here, recorded in its input: a resume on a replacement
            # head node draws the same tokens (DECISIONS 68).
            prompt = prompt.model_copy(update={"seed": workflow.random().getrandbits(63)})
        update_id = (workflow.current_update_info() or _NoUpdate()).id
        wf_id = names.prompt_workflow_id(state.run_id, prompt.request_id, _safe(update_id))
        hosted = state.prompt_host is PromptHost.RUN
        record = state.admit(prompt.request_id, wf_id, update_id if hosted else None)
        admitted_at = workflow.now()
        head = state.head()
        # Next in line: the prompt is active from its start, so its workflow schedules
        # the generate activity in its first task instead of waiting for a signal (two
        # workflow tasks off the time to first token; DECISIONS 40).
        start_active = False
        if (
            state.may_activate(self._request.max_active_prompts)
            and state.pending[:1] == [record]
            and workflow.patched(names.PATCH_PROMPT_STARTS_ACTIVE)
        ):
            start_active = state.activate_next(self._request.max_active_prompts) is record
        max_new = effective_max_tokens(prompt.max_tokens, self._request.default_max_tokens)
        inp = PromptInput(
            run_id=state.run_id,
            readiness_id=head.readiness_id,
            prompt=prompt,
            max_new_tokens=max_new,
            head_task_queue=head.task_queue,
            head_node_id=head.node_id,
            generate_heartbeat_s=self._request.timeouts.generate_heartbeat_s,
            stream_batch_ms=self._request.stream_batch_ms,
            start_active=start_active,
            on_node_loss=self._request.on_node_loss,
            recovery_wait_s=_slack(self._request.recovery.replacement_timeout_s),
        )
        if hosted:
            outcome = await self._host_prompt(inp, wf_id, record, admitted_at)
        else:
            outcome = await self._prompt_workflow(inp, wf_id, record, head)
        ok = outcome.terminal.type == "done"
        state.finish_prompt(
            wf_id, ok, "" if ok else getattr(outcome.terminal, "error", ""), prompt.request_id
        )
        self._show()
        if outcome.run_fault is not None and not self._recovering():
            # The head's driver saw its pipeline fail: maybe a peer died (the watch names it).
            self._suspect(outcome.run_fault)
        return outcome.terminal

    async def _host_prompt(
        self, inp: PromptInput, wf_id: str, record: PromptRecord, admitted_at: datetime
    ) -> PromptOutcome:
        """Serve the prompt in this Update (DECISIONS 66): no workflow of its own, its text
        to the head node's direct readers only, its end kept for a re-attach."""
        serving = PromptServing(inp, wf_id, temporal_text=False, turn=lambda: record.active)
        self._hosted[wf_id] = serving
        self._show()
        try:
            outcome = await serving.serve(details=False)
        except Exception as err:  # a defect in serving it: this prompt ends, then the run
            outcome = PromptOutcome(
                terminal=Fault(
                    request_id=inp.prompt.request_id,
                    # The type only: an error's text may quote what the prompt generated.
                    error=f"prompt serving failed: {type(err).__name__}",
                ),
                run_fault=f"prompt serving: prompt {wf_id} failed",
                status=PromptStatus.FAULTED,
            )
        finally:
            self._hosted.pop(wf_id, None)
        serving.ended(outcome, admitted_at)
        self._keep_served(
            ServedPrompt(
                workflow_id=wf_id,
                outcome=outcome,
                admitted_ms=int(admitted_at.timestamp() * 1000),
                stop=list(inp.prompt.stop),
            )
        )
        return outcome

    def _keep_served(self, served: ServedPrompt) -> None:
        """Keep ``served`` as the latest, within SERVED_KEPT and SERVED_TEXT_KEPT."""
        self._served.pop(served.workflow_id, None)
        self._served[served.workflow_id] = served
        text = sum(_text_size(p) for p in self._served.values())
        while len(self._served) > 1 and (
            len(self._served) > SERVED_KEPT or text > SERVED_TEXT_KEPT
        ):
            _, dropped = self._served.popitem(last=False)
            text -= _text_size(dropped)

    async def _prompt_workflow(
        self, inp: PromptInput, wf_id: str, record: PromptRecord, head: NodeState
    ) -> PromptOutcome:
        """Serve the prompt in a child PromptWorkflow of its own."""
        state = self._state
        prompt = inp.prompt
        child = await workflow.start_child_workflow(
            PromptWorkflow.run,
            inp,
            id=wf_id,
            task_queue=names.ORCHESTRATOR_TASK_QUEUE,
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            execution_timeout=timedelta(days=1),
            task_timeout=WORKFLOW_TASK_TIMEOUT,
            # Ids and counts only: the prompt's text never goes into user metadata.
            static_summary=f"prompt {prompt.request_id} of run {state.run_id}",
            static_details=(
                f"run {state.run_id} · request {prompt.request_id} · "
                f"{'chat' if prompt.chat else 'completion'} · max tokens "
                f"{inp.max_new_tokens} · "
                f"head node {head.node_id} (stage {head.stage_index})"
            ),
        )
        self._children[wf_id] = child
        self._started_children.add(wf_id)
        self._show()
        news = self._head_news(inp)
        if news is not None:  # its head was replaced, or is being, since it was admitted
            await child.signal(names.SIGNAL_PROMPT_HEAD, news)
        early = self._early_cancels.pop(wf_id, None)
        if early is not None:
            await self._cancel_child(wf_id, early)
        await workflow.wait_condition(lambda: record.active or child.done() or state.stopping)
        if record.active and not child.done() and not inp.start_active:
            await child.signal(names.SIGNAL_PROMPT_ACTIVATE)
        elif state.stopping and not child.done():
            await self._cancel_child(wf_id, "run is shutting down")
        try:
            outcome: PromptOutcome = await child
        except ChildWorkflowError as err:
            outcome = PromptOutcome(
                terminal=Fault(
                    request_id=prompt.request_id, error=f"prompt workflow failed: {err}"
                ),
                run_fault=f"prompt serving: prompt workflow {wf_id} failed",
                status=PromptStatus.FAULTED,
            )
        self._children.pop(wf_id, None)
        return outcome

    @submit_prompt.validator
    def _validate_prompt(self, *args: Any) -> None:
        prompt = self._prompt_of(args)
        if prompt.messages is not None and not prompt.chat:
            raise ApplicationError(
                "InvalidPrompt: messages need chat=true (they are rendered with the model's "
                "chat template)",
                type=ErrorType.INVALID_PROMPT,
                non_retryable=True,
            )
        if not prompt.prompt_text and not prompt.messages:
            raise ApplicationError(
                "InvalidPrompt: prompt_text must not be empty",
                type=ErrorType.INVALID_PROMPT,
                non_retryable=True,
            )
        rejection = self._state.admission_rejection(
            prompt.request_id,
            prompt_limit(self._request.prompt_queue_capacity, self._request.max_active_prompts),
            self._rolling_over,
        )
        if rejection is not None:
            raise ApplicationError(
                self._state.rejection_text(rejection, prompt.request_id),
                type=rejection.value,
                non_retryable=rejection is not PromptRejection.ROLLING_OVER,
            )

    def _prompt_of(self, args: Sequence[Any]) -> SubmitPrompt:
        """The update's SubmitPrompt, or a typed InvalidPrompt naming the bad fields."""
        try:
            return decode_one(names.UPDATE_SUBMIT_PROMPT, SubmitPrompt, args)
        except InvalidInput as err:
            raise ApplicationError(
                f"InvalidPrompt: {err.reason}", type=ErrorType.INVALID_PROMPT, non_retryable=True
            ) from None

    def cancel_prompt(self, cancel: CancelPrompt) -> Any:
        record = self._state.prompt(cancel.request_id)
        if record is None:
            return self._ignore(
                names.SIGNAL_CANCEL_PROMPT, f"no active or pending prompt {cancel.request_id}"
            )
        self._state.remove_pending(cancel.request_id)
        return self._cancel_child(record.workflow_id, "cancelled")

    async def _cancel_child(self, wf_id: str, reason: str) -> None:
        hosted = self._hosted.get(wf_id)
        if hosted is not None:
            hosted.cancel(reason)
            return
        child = self._children.get(wf_id)
        if (
            child is None
            and wf_id not in self._started_children
            and workflow.patched(names.PATCH_CANCEL_BEFORE_CHILD_START)
        ):
            # Admitted (maybe active already) but its PromptWorkflow not started yet: the
            # cancel is sent once it has started (_serve_prompt), not lost.
            self._early_cancels.setdefault(wf_id, reason)
            return
        if child is None or child.done():
            return
        try:
            await child.signal(names.SIGNAL_PROMPT_CANCEL, reason)
        except Exception:
            workflow.logger.info("cancel signal to %s not delivered", wf_id)

    # ------------------------------------------------------------------ shutdown and reports
    def request_shutdown(self, req: RequestShutdown) -> None:
        if req.run_id is not None and req.run_id != self._state.run_id:
            self._ignore(
                names.SIGNAL_REQUEST_SHUTDOWN,
                f"run_id {req.run_id} is not this run ({self._state.run_id})",
            )
            return
        self._state.request_shutdown(req.reason)

    @workflow.update(name=names.UPDATE_SHUTDOWN_AND_WAIT)
    async def request_shutdown_and_wait(self, *args: Any) -> RunOutcome:
        self.request_shutdown(self._shutdown_of(args))
        if workflow.patched(names.PATCH_SHUTDOWN_WAITS_CLOSE):
            # Answered with the workflow's own completion: a caller that stops its worker
            # next (the demo, a host) never leaves the run open on its datastream's end.
            await workflow.wait_condition(lambda: self._closing)
        else:
            await workflow.wait_condition(lambda: self._state.torn_down)
        return self._state.outcome()

    @request_shutdown_and_wait.validator
    def _validate_shutdown(self, *args: Any) -> None:
        req = self._shutdown_of(args)
        if req.run_id is not None and req.run_id != self._state.run_id:
            raise ApplicationError(
                f"InvalidShutdown: run_id {req.run_id} is not this run ({self._state.run_id})",
                type=ErrorType.INVALID_SHUTDOWN,
                non_retryable=True,
            )

    def _shutdown_of(self, args: Sequence[Any]) -> RequestShutdown:
        try:
            return decode_one(
                names.UPDATE_SHUTDOWN_AND_WAIT, RequestShutdown, args, missing_is_default=True
            )
        except InvalidInput as err:
            raise ApplicationError(
                f"InvalidShutdown: {err.reason}",
                type=ErrorType.INVALID_SHUTDOWN,
                non_retryable=True,
            ) from None

    @workflow.signal(dynamic=True)
    async def on_signal(self, name: str, args: Sequence[RawValue]) -> None:
        """Every signal of the run, decoded here: its payload is untrusted (the CLI, the
        Web UI, a stale node). A malformed, mismatched or unknown one is ignored, counted
        and described in ``snapshot`` and the worker log; none can fail the run."""
        self._busy_handlers += 1
        try:
            await self._handle_signal(name, args)
        finally:
            self._busy_handlers -= 1

    async def _handle_signal(self, name: str, args: Sequence[RawValue]) -> None:
        route = _SIGNALS.get(name)
        if route is None:
            self._ignore(name, "unknown signal")
            return
        model, handler = route
        values: list[Any] = []
        for raw in args:
            try:
                values.append(workflow.payload_converter().from_payload(raw.payload))
            except Exception:
                values.append(NotJson())
        try:
            message = decode_one(
                name, model, values, missing_is_default=name == names.SIGNAL_REQUEST_SHUTDOWN
            )
        except InvalidInput as err:
            self._ignore(name, err.reason)
            return
        result = handler(self, message)
        if inspect.isawaitable(result):
            await result
        self._observe()  # a node report moves a node to another state
        if self._state.suspected_fault is not None:
            self._start_grace()

    def _ignore(self, kind: str, reason: str) -> None:
        self._state.ignore(kind, reason)
        workflow.logger.warning("ignored %s: %s", kind, reason)

    def _suspect(self, reason: str) -> None:
        if self._state.suspect(reason):
            self._start_grace()

    def _start_grace(self) -> None:
        """After a survivor's fault report: give the provider watch a moment to find the
        node that died, then fault with the report if none did."""
        if self._grace is not None:
            return
        state = self._state

        grace = CULPRIT_GRACE
        if self._request.on_node_loss is NodeLossPolicy.REPLACE:
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

    def node_runtime_ready(self, report: NodeRuntimeReady) -> None:
        self._state.on_runtime_ready(report)

    def lease_started(self, report: LeaseStarted) -> None:
        self._state.on_lease_started(report)

    def weights_ready(self, report: WeightsReady) -> None:
        self._state.on_weights_ready(report)

    def stage_ready(self, report: StageReady) -> None:
        self._state.on_stage_ready(report)

    def stage_fault(self, report: StageFault) -> None:
        self._state.on_stage_fault(report)

    def token_endpoints_ready(self, report: TokenEndpointsReady) -> None:
        self._state.on_token_endpoints_ready(report)

    def stage_stopped(self, report: StageStopped) -> None:
        self._state.on_stage_stopped(report)

    def datastream_address(self, report: DatastreamAddress) -> None:
        """Where the run's datastream is served now (observation only, DECISIONS 58)."""
        if report.run_id != self._state.run_id:
            self._ignore(names.SIGNAL_DATASTREAM_ADDRESS, f"run_id {report.run_id} is not this run")
            return
        self._state.datastream = report

    @workflow.query(name=names.QUERY_PROMPT_SERVED)
    def prompt_served(self, request_id: int) -> ServedPrompt | None:
        """The latest run-hosted prompt ``request_id`` that ended, while the run keeps it
        (DECISIONS 66); None for one still open, one of a PromptWorkflow, or one too old."""
        for served in reversed(self._served.values()):
            if served.outcome.terminal.request_id == request_id:
                return served
        return None

    @workflow.query(name=names.QUERY_PROMPT_STOPS)
    def prompt_stops(self, request_id: int) -> list[str] | None:
        """The stop strings of run-hosted prompt ``request_id``, in flight or kept (a
        re-attach cuts its text where the original response was); None if unknown."""
        for serving in reversed(self._hosted.values()):
            if serving.inp.prompt.request_id == request_id:
                return list(serving.inp.prompt.stop)
        served = self.prompt_served(request_id)
        return None if served is None else served.stop

    @workflow.query(name=names.QUERY_SNAPSHOT)
    def snapshot(self) -> RunState:
        """The run's state; the full execution nonce stays inside (its first 8 characters,
        in queue names and readiness ids, are shown)."""
        return self._state.model_copy(update={"nonce": self._state.nonce[:8]})

    # ------------------------------------------------------------------ teardown
    async def _teardown(self) -> None:
        """StopRun, StageStopped, provider stop, RunTornDown once (DECISIONS 16)."""
        state = self._state
        self._set_phase(RunPhase.TEARING_DOWN)
        state.record(LifecycleKind.RUN_TEARING_DOWN, state.first_fault or (state.shutdown or ""))
        for wf_id in [*self._hosted, *self._children]:
            await self._cancel_child(
                wf_id,
                "run is shutting down"
                if state.first_fault is None
                else f"run faulted: {state.first_fault}",
            )
        # Leases end now; the provider watch runs on so that a node dying now is skipped.
        await self._cancel_background(watch=False)
        await self._stop_stages()
        await asyncio.gather(*(self._stop_node(n) for n in state.nodes_to_stop()))
        await self._cancel_background(leases=False)
        if state.uses_token_endpoints:
            # The token endpoints live on the head's driver; its StopRun tears them down.
            head = state.head()
            state.token_endpoints_stopped = head.stage_stopped or head.provider_stopped
        await self._drain_prompts()
        state.record(LifecycleKind.RUN_TORN_DOWN, state.first_stop_error or "")
        self._set_phase(RunPhase.TORN_DOWN)
        drained: Callable[[], bool] = workflow.all_handlers_finished
        if workflow.patched(names.PATCH_SHUTDOWN_WAITS_CLOSE):
            # A shutdown Update waits for the run's close (DECISIONS 59): not for this.
            drained = lambda: self._busy_handlers == 0  # noqa: E731
        try:
            await workflow.wait_condition(drained, timeout=HANDLERS_DRAIN.total_seconds())
        except TimeoutError:
            workflow.logger.warning("prompt handlers still open after teardown")

    async def _stop_stages(self) -> None:
        """StopRun to every stage that may run, then StageStopped from each, in time."""
        state, t = self._state, self._request.timeouts
        await asyncio.gather(*(self._stop_stage(n) for n in state.stages_to_stop()))
        try:
            await workflow.wait_condition(
                state.stage_stops_observed, timeout=max(t.stage_stopped_wait_s, 0.001)
            )
        except TimeoutError:
            missing = [n.stage_index for n in state.stages_to_stop() if not n.stage_stopped]
            state.stop_error(f"StageStopped not observed for stage(s) {missing}")

    async def _stop_stage(self, node: NodeState) -> None:
        state = self._state
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
                self._request.timeouts,
                f"stop stage {node.stage_index} on node {node.node_id}",
            )
        )
        await workflow.wait_condition(lambda: task.done() or node.exited)
        if not task.done():
            _abandon(task)  # the node is gone: nothing left to stop there
            return
        try:
            await task
        except ActivityError as err:
            state.stop_error(
                f"StopRun stage {node.stage_index} (node {node.node_id}): {failure_cause(err)}"
            )

    async def _stop_node(self, node: NodeState) -> bool:
        """The provider stop of ``node``: False where it failed (a node that may still run)."""
        state, t = self._state, self._request.timeouts
        stopped = True
        assert state.provider_queue is not None
        handle = node.handle or NodeHandle(  # a start that never reported back
            run_id=state.run_id,
            node_id=node.node_id,
            provider=self._request.provider,
            host="",
            resource_name=names.node_resource_name(state.run_id, node.node_id, state.nonce),
        )
        try:
            result: StopNodeResult = await calls.stop_node(
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

    async def _drain_prompts(self) -> None:
        """Every admitted prompt has its one terminal event before RunTornDown. A prompt
        whose head node died ends only when its generate's heartbeat times out."""
        t = self._request.timeouts
        try:
            await workflow.wait_condition(
                lambda: not self._children and not self._hosted,
                timeout=t.generate_heartbeat_s + PROMPT_DRAIN_S,
            )
        except TimeoutError:
            self._state.stop_error(
                f"prompt(s) {sorted([*self._hosted, *self._children])} had no terminal "
                "event in time"
            )

    def _set_phase(self, phase: RunPhase) -> None:
        self._state.phase = phase
        workflow.upsert_search_attributes([PHASE_KEY.value_set(phase.value)])
        if phase is RunPhase.PROMPT_READY and not self._state.continued and not self._ready_seen:
            # Time to prompt-ready, in workflow time from the run's start (its first
            # execution; a continued run was ready before).
            self._ready_seen = True
            elapsed = workflow.now() - workflow.info().start_time
            metrics.sink().record_prompt_ready(self._state.run_id, elapsed.total_seconds() * 1000)
        self._show()

    def _observe(self) -> None:
        """The run's gauges: its prompt queue and its nodes by state (nothing while the
        workflow replays, nothing at all with metrics off: mvp_core.metrics)."""
        state = self._state
        counts = dict.fromkeys(NODE_CONDITIONS, 0)
        for node in state.nodes:
            counts[node.condition()] += 1
        queued = state.prompts_in_flight()
        metrics.sink().record_run_gauges(state.run_id, queued, counts)

    def _model_name(self) -> str:
        """The model's name: the request's bundled name or file name, else the plan's."""
        name = self._request.model.display_name()
        if name is not None:
            return name
        if self._state.plan is not None:
            return self._state.plan.model_facts.name
        return "the default model"

    def _show(self) -> None:
        """The run's current details in the Web UI: model, stages, provider, phase and
        prompt counts. Names, ids and counts only (never prompt text or secrets); it lives
        in the worker and is served by the metadata query, so history is unchanged."""
        state, req = self._state, self._request
        stages = state.plan.stage_count if state.plan is not None else req.pipeline_stages
        ids = [str(p.request_id) for p in state.actives()]
        active = f", request{'s' if len(ids) > 1 else ''} {', '.join(ids)} active" if ids else ""
        lines = [  # the phase first: the line the Web UI's workflow view shows on top
            f"**phase: {state.phase.value}**",
            f"**run {state.run_id}**: {self._model_name()} in {stages} stage(s), "
            f"provider {req.provider.value}",
            f"prompts: {state.prompts_completed} completed, {len(state.pending)} queued{active}",
        ]
        if state.continued:
            lines.append(f"continued as new {state.continued} time(s)")
        if state.first_fault is not None:
            lines.append("faulted (see the run's outcome)")
        workflow.set_current_details("\n\n".join(lines))
        self._observe()


_SIGNALS: dict[str, tuple[type[BaseModel], Any]] = {
    names.SIGNAL_REQUEST_SHUTDOWN: (RequestShutdown, RunWorkflow.request_shutdown),
    names.SIGNAL_CANCEL_PROMPT: (CancelPrompt, RunWorkflow.cancel_prompt),
    names.SIGNAL_NODE_RUNTIME_READY: (NodeRuntimeReady, RunWorkflow.node_runtime_ready),
    names.SIGNAL_LEASE_STARTED: (LeaseStarted, RunWorkflow.lease_started),
    names.SIGNAL_WEIGHTS_READY: (WeightsReady, RunWorkflow.weights_ready),
    names.SIGNAL_STAGE_READY: (StageReady, RunWorkflow.stage_ready),
    names.SIGNAL_STAGE_FAULT: (StageFault, RunWorkflow.stage_fault),
    names.SIGNAL_TOKEN_ENDPOINTS_READY: (TokenEndpointsReady, RunWorkflow.token_endpoints_ready),
    names.SIGNAL_STAGE_STOPPED: (StageStopped, RunWorkflow.stage_stopped),
    names.SIGNAL_DATASTREAM_ADDRESS: (DatastreamAddress, RunWorkflow.datastream_address),
}


class _NoUpdate:
    id = "noupdate"


def _text_size(served: ServedPrompt) -> int:
    terminal = served.outcome.terminal
    text = terminal.final_text if terminal.type == "done" else terminal.text
    return len(text or "")


def _slack(bound_s: float) -> float:
    """A prompt's wait for a recovery: the run's bound and RECOVERY_SLACK_S (at most a day)."""
    return min(bound_s + RECOVERY_SLACK_S, 86_400.0)


def _now_ms() -> int:
    """Workflow time, in milliseconds since the epoch."""
    return int(workflow.now().timestamp() * 1000)


def _abandon(task: asyncio.Task[Any]) -> None:
    """Cancel an activity the run no longer waits for. Its end (``ActivityError:
    Activity cancelled``) is taken here: left unread, the task's garbage collection
    logged it as "Task exception was never retrieved" in the worker's log."""
    task.add_done_callback(retrieve)
    task.cancel()


def _safe(update_id: str) -> str:
    cleaned = "".join(c for c in update_id if c.isalnum() or c == "-")
    return cleaned[:36] or "u"


def _describe(err: BaseException) -> str:
    if isinstance(err, ActivityError):
        return failure_cause(err)
    if isinstance(err, ApplicationError):
        return err.message
    return f"{type(err).__name__}: {err}"
