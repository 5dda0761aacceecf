"""Every activity the workflows schedule, as a typed call with its timeouts and retry
policy named here, in one place.

The workflows read as their lifecycle; what each step may cost (how long, how often it
is tried, when it is given up) is decided here. Each call is the same command the
recorded histories hold (activity type, task queue, input), so replay is unchanged.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.errors import ErrorType
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
        RunTimeouts,
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

# ---------------------------------------------------------------- the budgets
# Orchestrator-side activities heartbeat, so a lost worker costs this, not a timeout.
ACTIVITY_HEARTBEAT = timedelta(seconds=5)
PROVIDER_QUEUE_TIMEOUT = timedelta(seconds=10)
PLAN_TIMEOUT = timedelta(minutes=10)  # a model's header read, or its download
PLAN_RETRY = RetryPolicy(maximum_attempts=3, non_retryable_error_types=[ErrorType.PLANNING_ERROR])
START_RETRY = RetryPolicy(maximum_attempts=3)
ROUTE_CHECK_TIMEOUT = timedelta(seconds=10)  # one DescribeTaskQueue
# A node's poller shows within ~0.1 s of its start: look again soon, then less often.
ROUTE_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200),
    backoff_coefficient=1.5,
    maximum_interval=timedelta(seconds=2),
)
STAGE_HEARTBEAT = timedelta(seconds=30)  # a stage's weights load heartbeats while it reads
STAGE_RETRY = RetryPolicy(maximum_attempts=2, non_retryable_error_types=[ErrorType.STAGE_REJECTED])
# Leases and the provider watch last as long as the run: their end is the news.
FOR_THE_RUN = timedelta(days=30)
LEASE_RETRY = RetryPolicy(maximum_attempts=1)  # a lost lease is scheduled anew by the run
WATCH_HEARTBEAT = timedelta(seconds=10)
WATCH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5)
)
STOP_STAGE_RETRY = RetryPolicy(maximum_attempts=2)
STOP_NODE_RETRY = RetryPolicy(maximum_attempts=3)
GENERATE_SCHEDULE_TO_START = timedelta(seconds=30)  # the head node's worker polls its queue
GENERATE_TIMEOUT = timedelta(hours=6)
GENERATE_RETRY = RetryPolicy(
    maximum_attempts=1
)  # a retry would publish the text twice (DECISIONS 11)
STOP_GENERATE_WITHIN = timedelta(seconds=10)
STOP_GENERATE_RETRY = RetryPolicy(maximum_attempts=3, initial_interval=timedelta(milliseconds=200))
REAPER_HEARTBEAT = timedelta(seconds=10)
# A host whose workers are all gone never takes the listing: the sweep fails instead of
# waiting, and the schedule's next sweep tries again.
REAPER_LIST_TIMEOUT = timedelta(seconds=120)
REAPER_LIVENESS_TIMEOUT = timedelta(seconds=120)
REAPER_RETRY = RetryPolicy(maximum_attempts=3, initial_interval=timedelta(seconds=1))


def _seconds(s: float) -> timedelta:
    return timedelta(seconds=s)


# ---------------------------------------------------------------- planning (orchestrator)
def provider_queue(summary: str) -> Any:
    """The task queue of the provider host that serves this run's provider."""
    return workflow.execute_activity(
        names.ACT_PROVIDER_QUEUE,
        result_type=str,
        task_queue=names.ORCHESTRATOR_TASK_QUEUE,
        start_to_close_timeout=PROVIDER_QUEUE_TIMEOUT,
        summary=summary,
    )


def prepare_plan(inp: PreparePlanInput, queue: str, summary: str) -> Any:
    """The run's committed plan (GGUF facts, stages, edges, rings)."""
    return workflow.execute_activity(
        names.ACT_PREPARE_PLAN,
        inp,
        result_type=RunPlan,
        task_queue=queue,
        summary=summary,
        start_to_close_timeout=PLAN_TIMEOUT,
        heartbeat_timeout=ACTIVITY_HEARTBEAT,
        retry_policy=PLAN_RETRY,
    )


# ---------------------------------------------------------------- nodes (provider host)
def start_node(spec: NodeProvisionSpec, queue: str, timeout_s: float, summary: str) -> Any:
    return workflow.execute_activity(
        names.ACT_START_NODE,
        spec,
        result_type=NodeHandle,
        task_queue=queue,
        start_to_close_timeout=_seconds(timeout_s),
        summary=summary,
        heartbeat_timeout=ACTIVITY_HEARTBEAT,
        retry_policy=START_RETRY,
    )


def watch_nodes(
    inp: WatchNodesInput, queue: str, summary: str, *, wait_for_cancel: bool = False
) -> Any:
    """Ends when one of the nodes' runtimes is gone, naming it. ``wait_for_cancel``: a
    cancel waits for the activity to end (a run then closes only after its watch)."""
    return workflow.execute_activity(
        names.ACT_WATCH_NODES,
        inp,
        result_type=NodeExited,
        task_queue=queue,
        summary=summary,
        start_to_close_timeout=FOR_THE_RUN,
        heartbeat_timeout=WATCH_HEARTBEAT,
        retry_policy=WATCH_RETRY,
        cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED
        if wait_for_cancel
        else workflow.ActivityCancellationType.TRY_CANCEL,
    )


DATASTREAM_HEARTBEAT = timedelta(seconds=10)
DATASTREAM_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10)
)


def run_datastream(inp: RunDatastreamInput, queue: str) -> Any:
    """The run's datastream (DECISIONS 58): runs until cancelled; a cancel waits for it to
    publish the run's last records and close its archive."""
    return workflow.execute_activity(
        names.ACT_RUN_DATASTREAM,
        inp,
        task_queue=queue,
        summary=f"datastream of run {inp.run_id}",
        start_to_close_timeout=FOR_THE_RUN,
        heartbeat_timeout=DATASTREAM_HEARTBEAT,
        retry_policy=DATASTREAM_RETRY,
        cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
    )


def stop_node(inp: StopNodeInput, queue: str, allowance_s: float, summary: str) -> Any:
    return workflow.execute_activity(
        names.ACT_STOP_NODE,
        inp,
        result_type=StopNodeResult,
        task_queue=queue,
        summary=summary,
        start_to_close_timeout=_seconds(inp.grace_s + allowance_s),
        heartbeat_timeout=ACTIVITY_HEARTBEAT,
        retry_policy=STOP_NODE_RETRY,
    )


# ---------------------------------------------------------------- readiness
def check_route(inp: CheckRouteInput, remaining_s: float, summary: str) -> Any:
    """Whether the node's queue has a poller of the identity it reported, tried until
    ``remaining_s`` (the readiness deadline) runs out."""
    return workflow.execute_activity(
        names.ACT_CHECK_ROUTE,
        inp,
        result_type=RouteCheck,
        task_queue=names.ORCHESTRATOR_TASK_QUEUE,
        summary=summary,
        start_to_close_timeout=ROUTE_CHECK_TIMEOUT,
        schedule_to_close_timeout=_seconds(remaining_s),
        retry_policy=ROUTE_RETRY,
    )


def ack_runtime_ready(ack: NodeRuntimeReadyAck, queue: str, t: RunTimeouts, summary: str) -> Any:
    """RuntimeReadyAck, resent every ``ack_resend_s`` until ``ack_s`` (actor spec)."""
    return workflow.execute_activity(
        names.ACT_NODE_RUNTIME_READY_ACK,
        ack,
        result_type=NodeRuntimeReadyAck,
        task_queue=queue,
        summary=summary,
        start_to_close_timeout=_seconds(max(t.ack_resend_s, 1.0)),
        schedule_to_close_timeout=_seconds(t.ack_s),
        retry_policy=RetryPolicy(
            initial_interval=_seconds(t.ack_resend_s), backoff_coefficient=1.0
        ),
    )


def lease(
    inp: LeaseInput, queue: str, start_within: timedelta, t: RunTimeouts, summary: str
) -> Any:
    """The node's membership lease: it heartbeats for as long as the node lives."""
    return workflow.execute_activity(
        names.ACT_NODE_LEASE,
        inp,
        task_queue=queue,
        summary=summary,
        schedule_to_start_timeout=start_within,
        start_to_close_timeout=FOR_THE_RUN,
        heartbeat_timeout=_seconds(t.lease_heartbeat_s),
        retry_policy=LEASE_RETRY,
        cancellation_type=workflow.ActivityCancellationType.TRY_CANCEL,
    )


def provision_stage(provision: StageProvision, queue: str, t: RunTimeouts, summary: str) -> Any:
    """The stage's layers loaded and its edges started (WeightsReady follows)."""
    return workflow.execute_activity(
        names.ACT_NODE_PROVISION_STAGE,
        provision,
        task_queue=queue,
        summary=summary,
        start_to_close_timeout=_seconds(t.weight_load_s),
        heartbeat_timeout=STAGE_HEARTBEAT,
        retry_policy=STAGE_RETRY,
    )


def stop_stage(stop: StopRun, queue: str, t: RunTimeouts, summary: str) -> Any:
    wait = _seconds(max(t.stage_stopped_wait_s, 1))
    return workflow.execute_activity(
        names.ACT_NODE_STOP_STAGE,
        stop,
        task_queue=queue,
        summary=summary,
        schedule_to_close_timeout=wait,
        start_to_close_timeout=wait,
        retry_policy=STOP_STAGE_RETRY,
    )


# ---------------------------------------------------------------- prompts
def generate(inp: GenerateInput, queue: str, heartbeat_s: float, summary: str) -> Any:
    """The head node's token loop for one prompt (a handle: the prompt may cancel it)."""
    return workflow.start_activity(
        names.ACT_NODE_GENERATE,
        inp,
        result_type=PromptOutcome,
        task_queue=queue,
        summary=summary,
        schedule_to_start_timeout=GENERATE_SCHEDULE_TO_START,
        start_to_close_timeout=GENERATE_TIMEOUT,
        heartbeat_timeout=_seconds(heartbeat_s),
        retry_policy=GENERATE_RETRY,
        cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
    )


def stop_generate(inp: StopGenerateInput, queue: str, summary: str) -> Any:
    """A cancelled prompt's stop, straight to the head node: its generate stops at the next
    step, not at the next heartbeat's answer (DECISIONS 65). Bounded: a node that is gone
    leaves the generate's own cancel and heartbeat timeout to end it."""
    return workflow.start_activity(
        names.ACT_NODE_STOP_GENERATE,
        inp,
        result_type=bool,
        task_queue=queue,
        summary=summary,
        schedule_to_close_timeout=STOP_GENERATE_WITHIN,
        retry_policy=STOP_GENERATE_RETRY,
    )


# ---------------------------------------------------------------- the reaper
def list_resources(host: str, queue: str) -> Any:
    return workflow.execute_activity(
        names.ACT_LIST_RESOURCES,
        host,
        task_queue=queue,
        result_type=ResourceListing,
        schedule_to_close_timeout=REAPER_LIST_TIMEOUT,
        heartbeat_timeout=REAPER_HEARTBEAT,
        retry_policy=REAPER_RETRY,
    )


def run_liveness(inp: LivenessInput) -> Any:
    return workflow.execute_activity(
        names.ACT_RUN_LIVENESS,
        inp,
        task_queue=names.ORCHESTRATOR_TASK_QUEUE,
        result_type=LivenessResult,
        schedule_to_close_timeout=REAPER_LIVENESS_TIMEOUT,
        heartbeat_timeout=REAPER_HEARTBEAT,
        retry_policy=REAPER_RETRY,
    )


def destroy_resource(inp: DestroyInput, queue: str, timeout_s: float) -> Any:
    return workflow.execute_activity(
        names.ACT_DESTROY_RESOURCE,
        inp,
        task_queue=queue,
        result_type=DestroyResult,
        start_to_close_timeout=_seconds(timeout_s),
        schedule_to_close_timeout=_seconds(3 * timeout_s),
        heartbeat_timeout=REAPER_HEARTBEAT,
        retry_policy=REAPER_RETRY,
    )
