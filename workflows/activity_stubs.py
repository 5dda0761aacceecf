"""The typed faces of every activity the workflows schedule, bound by name.

The workflows never import the rooms that implement these (``activities/``, the node
agent): each stub carries the activity's registered name and its signature, so
``workflow.execute_activity(stub, ...)`` checks the argument and returns the result's
type. ``tests/workflows/test_activity_stubs.py`` holds every stub against the
implementation registered under its name, so the two cannot drift apart.
"""

from __future__ import annotations

from temporalio import activity, workflow

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.models import (
        CheckRouteInput,
        GenerateInput,
        LeaseInput,
        NodeExited,
        NodeHandle,
        NodeProvisionSpec,
        NodeRuntimeReadyAck,
        PreparePlanInput,
        PromptOutcome,
        RouteCheck,
        RunDatastreamInput,
        RunPlan,
        StageProvision,
        StopGenerateInput,
        StopNodeInput,
        StopNodeResult,
        StopRun,
        WatchNodesInput,
    )
    from mvp_core.reaper import (
        DestroyInput,
        DestroyResult,
        LivenessInput,
        LivenessResult,
        ResourceListing,
    )


def _stub() -> NotImplementedError:
    return NotImplementedError("an activity stub: the worker runs the real one")


# ---------------------------------------------------------------- the orchestrator's
@activity.defn(name=names.ACT_PROVIDER_QUEUE)
async def provider_queue() -> str:
    raise _stub()


@activity.defn(name=names.ACT_PREPARE_PLAN)
async def prepare_plan(inp: PreparePlanInput) -> RunPlan:
    raise _stub()


@activity.defn(name=names.ACT_CHECK_ROUTE)
async def check_route(inp: CheckRouteInput) -> RouteCheck:
    raise _stub()


@activity.defn(name=names.ACT_RUN_LIVENESS)
async def run_liveness(inp: LivenessInput) -> LivenessResult:
    raise _stub()


# ---------------------------------------------------------------- the provider host's
@activity.defn(name=names.ACT_START_NODE)
async def start_node(spec: NodeProvisionSpec) -> NodeHandle:
    raise _stub()


@activity.defn(name=names.ACT_STOP_NODE)
async def stop_node(inp: StopNodeInput) -> StopNodeResult:
    raise _stub()


@activity.defn(name=names.ACT_WATCH_NODES)
async def watch_nodes(inp: WatchNodesInput) -> NodeExited:
    raise _stub()


@activity.defn(name=names.ACT_RUN_DATASTREAM)
async def run_datastream(inp: RunDatastreamInput) -> None:
    raise _stub()


@activity.defn(name=names.ACT_LIST_RESOURCES)
async def list_resources(host: str) -> ResourceListing:
    raise _stub()


@activity.defn(name=names.ACT_DESTROY_RESOURCE)
async def destroy_resource(inp: DestroyInput) -> DestroyResult:
    raise _stub()


# ---------------------------------------------------------------- a node's
@activity.defn(name=names.ACT_NODE_RUNTIME_READY_ACK)
async def runtime_ready_ack(ack: NodeRuntimeReadyAck) -> NodeRuntimeReadyAck:
    raise _stub()


@activity.defn(name=names.ACT_NODE_LEASE)
async def lease(inp: LeaseInput) -> None:
    raise _stub()


@activity.defn(name=names.ACT_NODE_PROVISION_STAGE)
async def provision_stage(prov: StageProvision) -> None:
    raise _stub()


@activity.defn(name=names.ACT_NODE_GENERATE)
async def generate(inp: GenerateInput) -> PromptOutcome:
    raise _stub()


@activity.defn(name=names.ACT_NODE_STOP_GENERATE)
async def stop_generate(inp: StopGenerateInput) -> bool:
    raise _stub()


@activity.defn(name=names.ACT_NODE_STOP_STAGE)
async def stop_stage(cmd: StopRun) -> None:
    raise _stub()
