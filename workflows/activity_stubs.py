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
    from mvp_core import models as m
    from mvp_core import names
    from mvp_core import reaper as r


def _stub() -> NotImplementedError:
    return NotImplementedError("an activity stub: the worker runs the real one")


# ---------------------------------------------------------------- the orchestrator's
@activity.defn(name=names.ACT_PROVIDER_QUEUE)
async def provider_queue() -> str:
    raise _stub()


@activity.defn(name=names.ACT_PREPARE_PLAN)
async def prepare_plan(inp: m.PreparePlanInput) -> m.RunPlan:
    raise _stub()


@activity.defn(name=names.ACT_CHECK_ROUTE)
async def check_route(inp: m.CheckRouteInput) -> m.RouteCheck:
    raise _stub()


@activity.defn(name=names.ACT_RUN_LIVENESS)
async def run_liveness(inp: r.LivenessInput) -> r.LivenessResult:
    raise _stub()


# ---------------------------------------------------------------- the provider host's
@activity.defn(name=names.ACT_START_NODE)
async def start_node(spec: m.NodeProvisionSpec) -> m.NodeHandle:
    raise _stub()


@activity.defn(name=names.ACT_STOP_NODE)
async def stop_node(inp: m.StopNodeInput) -> m.StopNodeResult:
    raise _stub()


@activity.defn(name=names.ACT_COMPLETE_BOOTSTRAP)
async def complete_bootstrap(inp: m.CompleteBootstrapInput) -> m.CompleteBootstrapResult:
    raise _stub()


@activity.defn(name=names.ACT_WATCH_NODES)
async def watch_nodes(inp: m.WatchNodesInput) -> m.NodeExited:
    raise _stub()


@activity.defn(name=names.ACT_RUN_DATASTREAM)
async def run_datastream(inp: m.RunDatastreamInput) -> None:
    raise _stub()


@activity.defn(name=names.ACT_LIST_RESOURCES)
async def list_resources(host: str) -> r.ResourceListing:
    raise _stub()


@activity.defn(name=names.ACT_DESTROY_RESOURCE)
async def destroy_resource(inp: r.DestroyInput) -> r.DestroyResult:
    raise _stub()


# ---------------------------------------------------------------- a node's
@activity.defn(name=names.ACT_NODE_RUNTIME_READY_ACK)
async def runtime_ready_ack(ack: m.NodeRuntimeReadyAck) -> m.NodeRuntimeReadyAck:
    raise _stub()


@activity.defn(name=names.ACT_NODE_LEASE)
async def lease(inp: m.LeaseInput) -> None:
    raise _stub()


@activity.defn(name=names.ACT_NODE_PROVISION_STAGE)
async def provision_stage(prov: m.StageProvision) -> None:
    raise _stub()


@activity.defn(name=names.ACT_NODE_GENERATE)
async def generate(inp: m.GenerateInput) -> m.PromptOutcome:
    raise _stub()


@activity.defn(name=names.ACT_NODE_STOP_GENERATE)
async def stop_generate(inp: m.StopGenerateInput) -> bool:
    raise _stub()


@activity.defn(name=names.ACT_NODE_STOP_STAGE)
async def stop_stage(cmd: m.StopRun) -> None:
    raise _stub()
