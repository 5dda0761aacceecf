"""Every activity the workflows schedule, as a typed call with its timeouts and retry
policy named here, in one place.

The workflows read as their lifecycle; what each step may cost (how long, how often it
is tried, when it is given up) is decided here. Each call goes through the activity's
typed stub (``activity_stubs.py``), so its argument and result are type-checked, and is
the same command the recorded histories hold (activity type, task queue, input), so
replay is unchanged. Option sets used by more than one call are ``ActivityConfig``
bundles.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityCancellationType, ActivityConfig, ActivityHandle

with workflow.unsafe.imports_passed_through():
    from mvp_core.errors import ErrorType
    from mvp_core.models import (
        CheckRouteInput,
        CompleteBootstrapInput,
        CompleteBootstrapResult,
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
    from workflows import activity_stubs as stub

# ---------------------------------------------------------------- the budgets
# Orchestrator-side activities heartbeat, so a lost worker costs this, not a timeout.
ACTIVITY_HEARTBEAT = timedelta(seconds=5)
PROVIDER_QUEUE_TIMEOUT = timedelta(seconds=10)
PLAN_TIMEOUT = timedelta(minutes=10)  # a model's header read, or its download
PLAN_RETRY = RetryPolicy(maximum_attempts=3, non_retryable_error_types=[ErrorType.PLANNING_ERROR])
START_RETRY = RetryPolicy(maximum_attempts=3)
# One SSH command a rented node at most; a worker without the activity (an older one) is
# a failure the run records, not a retry forever.
COMPLETE_BOOTSTRAP_TIMEOUT = timedelta(seconds=60)
COMPLETE_BOOTSTRAP_RETRY = RetryPolicy(maximum_attempts=3)
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


DATASTREAM_HEARTBEAT = timedelta(seconds=10)
DATASTREAM_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10)
)

# ---------------------------------------------------------------- the option bundles
# An activity that runs for the run's whole life: its end is the news.
FOR_THE_RUN_CONFIG = ActivityConfig(start_to_close_timeout=FOR_THE_RUN)
# The reaper's sweeps: heartbeating, tried a few times.
REAPER_CONFIG = ActivityConfig(heartbeat_timeout=REAPER_HEARTBEAT, retry_policy=REAPER_RETRY)
# A provider-host activity that heartbeats while it waits on a provider.
PROVIDER_CONFIG = ActivityConfig(heartbeat_timeout=ACTIVITY_HEARTBEAT)


def _seconds(s: float) -> timedelta:
    return timedelta(seconds=s)


def _here() -> str:
    """The orchestrator's task queue: the one the calling workflow runs on."""
    return workflow.info().task_queue


# ---------------------------------------------------------------- planning (orchestrator)
async def provider_queue(summary: str) -> str:
    """The task queue of the provider host that serves this run's provider."""
    return await workflow.execute_activity(
        stub.provider_queue,
        task_queue=_here(),
        start_to_close_timeout=PROVIDER_QUEUE_TIMEOUT,
        summary=summary,
    )


async def prepare_plan(inp: PreparePlanInput, queue: str, summary: str) -> RunPlan:
    """The run's committed plan (GGUF facts, stages, edges, rings)."""
    config: ActivityConfig = {
        **PROVIDER_CONFIG,
        "task_queue": queue,
        "summary": summary,
        "start_to_close_timeout": PLAN_TIMEOUT,
        "retry_policy": PLAN_RETRY,
    }
    return await workflow.execute_activity(stub.prepare_plan, inp, **config)


# ---------------------------------------------------------------- nodes (provider host)
async def start_node(
    spec: NodeProvisionSpec, queue: str, timeout_s: float, summary: str
) -> NodeHandle:
    config: ActivityConfig = {
        **PROVIDER_CONFIG,
        "task_queue": queue,
        "start_to_close_timeout": _seconds(timeout_s),
        "summary": summary,
        "retry_policy": START_RETRY,
    }
    return await workflow.execute_activity(stub.start_node, spec, **config)


async def complete_bootstrap(
    inp: CompleteBootstrapInput, queue: str, summary: str
) -> CompleteBootstrapResult:
    config: ActivityConfig = {
        **PROVIDER_CONFIG,
        "task_queue": queue,
        "start_to_close_timeout": COMPLETE_BOOTSTRAP_TIMEOUT,
        "summary": summary,
        "retry_policy": COMPLETE_BOOTSTRAP_RETRY,
    }
    return await workflow.execute_activity(stub.complete_bootstrap, inp, **config)


async def watch_nodes(
    inp: WatchNodesInput, queue: str, summary: str, *, wait_for_cancel: bool = False
) -> NodeExited:
    """Ends when one of the nodes' runtimes is gone, naming it. ``wait_for_cancel``: a
    cancel waits for the activity to end (a run then closes only after its watch)."""
    config: ActivityConfig = {
        **FOR_THE_RUN_CONFIG,
        "task_queue": queue,
        "summary": summary,
        "heartbeat_timeout": WATCH_HEARTBEAT,
        "retry_policy": WATCH_RETRY,
        "cancellation_type": ActivityCancellationType.WAIT_CANCELLATION_COMPLETED
        if wait_for_cancel
        else ActivityCancellationType.TRY_CANCEL,
    }
    return await workflow.execute_activity(stub.watch_nodes, inp, **config)


async def run_datastream(inp: RunDatastreamInput, queue: str) -> None:
    """The run's datastream (DECISIONS 58): runs until cancelled; a cancel waits for it to
    publish the run's last records and close its archive."""
    config: ActivityConfig = {
        **FOR_THE_RUN_CONFIG,
        "task_queue": queue,
        "summary": f"datastream of run {inp.run_id}",
        "heartbeat_timeout": DATASTREAM_HEARTBEAT,
        "retry_policy": DATASTREAM_RETRY,
        "cancellation_type": ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
    }
    await workflow.execute_activity(stub.run_datastream, inp, **config)


async def stop_node(
    inp: StopNodeInput, queue: str, allowance_s: float, summary: str
) -> StopNodeResult:
    config: ActivityConfig = {
        **PROVIDER_CONFIG,
        "task_queue": queue,
        "summary": summary,
        "start_to_close_timeout": _seconds(inp.grace_s + allowance_s),
        "retry_policy": STOP_NODE_RETRY,
    }
    return await workflow.execute_activity(stub.stop_node, inp, **config)


# ---------------------------------------------------------------- readiness
async def check_route(inp: CheckRouteInput, remaining_s: float, summary: str) -> RouteCheck:
    """Whether the node's queue has a poller of the identity it reported, tried until
    ``remaining_s`` (the readiness deadline) runs out."""
    return await workflow.execute_activity(
        stub.check_route,
        inp,
        task_queue=_here(),
        summary=summary,
        start_to_close_timeout=ROUTE_CHECK_TIMEOUT,
        schedule_to_close_timeout=_seconds(remaining_s),
        retry_policy=ROUTE_RETRY,
    )


async def ack_runtime_ready(
    ack: NodeRuntimeReadyAck, queue: str, t: RunTimeouts, summary: str
) -> NodeRuntimeReadyAck:
    """RuntimeReadyAck, resent every ``ack_resend_s`` until ``ack_s`` (actor spec)."""
    return await workflow.execute_activity(
        stub.runtime_ready_ack,
        ack,
        task_queue=queue,
        summary=summary,
        start_to_close_timeout=_seconds(max(t.ack_resend_s, 1.0)),
        schedule_to_close_timeout=_seconds(t.ack_s),
        retry_policy=RetryPolicy(
            initial_interval=_seconds(t.ack_resend_s), backoff_coefficient=1.0
        ),
    )


async def lease(
    inp: LeaseInput, queue: str, start_within: timedelta, t: RunTimeouts, summary: str
) -> None:
    """The node's membership lease: it heartbeats for as long as the node lives."""
    config: ActivityConfig = {
        **FOR_THE_RUN_CONFIG,
        "task_queue": queue,
        "summary": summary,
        "schedule_to_start_timeout": start_within,
        "heartbeat_timeout": _seconds(t.lease_heartbeat_s),
        "retry_policy": LEASE_RETRY,
        "cancellation_type": ActivityCancellationType.TRY_CANCEL,
    }
    await workflow.execute_activity(stub.lease, inp, **config)


async def provision_stage(
    provision: StageProvision, queue: str, t: RunTimeouts, summary: str
) -> None:
    """The stage's layers loaded and its edges started (WeightsReady follows)."""
    await workflow.execute_activity(
        stub.provision_stage,
        provision,
        task_queue=queue,
        summary=summary,
        start_to_close_timeout=_seconds(t.weight_load_s),
        heartbeat_timeout=STAGE_HEARTBEAT,
        retry_policy=STAGE_RETRY,
    )


async def stop_stage(stop: StopRun, queue: str, t: RunTimeouts, summary: str) -> None:
    wait = _seconds(max(t.stage_stopped_wait_s, 1))
    await workflow.execute_activity(
        stub.stop_stage,
        stop,
        task_queue=queue,
        summary=summary,
        schedule_to_close_timeout=wait,
        start_to_close_timeout=wait,
        retry_policy=STOP_STAGE_RETRY,
    )


# ---------------------------------------------------------------- prompts
def generate(
    inp: GenerateInput, queue: str, heartbeat_s: float, summary: str
) -> ActivityHandle[PromptOutcome]:
    """The head node's token loop for one prompt (a handle: the prompt may cancel it)."""
    return workflow.start_activity(
        stub.generate,
        inp,
        task_queue=queue,
        summary=summary,
        schedule_to_start_timeout=GENERATE_SCHEDULE_TO_START,
        start_to_close_timeout=GENERATE_TIMEOUT,
        heartbeat_timeout=_seconds(heartbeat_s),
        retry_policy=GENERATE_RETRY,
        cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
    )


def stop_generate(inp: StopGenerateInput, queue: str, summary: str) -> ActivityHandle[bool]:
    """A cancelled prompt's stop, straight to the head node: its generate stops at the next
    step, not at the next heartbeat's answer (DECISIONS 65). Bounded: a node that is gone
    leaves the generate's own cancel and heartbeat timeout to end it."""
    return workflow.start_activity(
        stub.stop_generate,
        inp,
        task_queue=queue,
        summary=summary,
        schedule_to_close_timeout=STOP_GENERATE_WITHIN,
        retry_policy=STOP_GENERATE_RETRY,
    )


# ---------------------------------------------------------------- the reaper
async def list_resources(host: str, queue: str) -> ResourceListing:
    config: ActivityConfig = {
        **REAPER_CONFIG,
        "task_queue": queue,
        "schedule_to_close_timeout": REAPER_LIST_TIMEOUT,
    }
    return await workflow.execute_activity(stub.list_resources, host, **config)


async def run_liveness(inp: LivenessInput) -> LivenessResult:
    config: ActivityConfig = {
        **REAPER_CONFIG,
        "task_queue": _here(),
        "schedule_to_close_timeout": REAPER_LIVENESS_TIMEOUT,
    }
    return await workflow.execute_activity(stub.run_liveness, inp, **config)


async def destroy_resource(inp: DestroyInput, queue: str, timeout_s: float) -> DestroyResult:
    config: ActivityConfig = {
        **REAPER_CONFIG,
        "task_queue": queue,
        "start_to_close_timeout": _seconds(timeout_s),
        "schedule_to_close_timeout": _seconds(3 * timeout_s),
    }
    return await workflow.execute_activity(stub.destroy_resource, inp, **config)
