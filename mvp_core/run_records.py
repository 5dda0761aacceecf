"""The records the run state machine keeps (``mvp_core.run_state``): each node of the run
and where it is, each prompt admitted, each stage recovery, and the typed rejections of a
prompt. Plain data with no rules of the run: those are ``RunState``'s."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel

from mvp_core.errors import ErrorType
from mvp_core.models import NodeHandle, NodeRuntimeReady

MAX_KIND = 64
MAX_REASON = 500  # a fault or refusal reason kept in state (reports are untrusted text)


def clip_reason(text: str) -> str:
    """``text`` within MAX_REASON characters: reasons come from untrusted reports."""
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 1] + "…"


def is_echo(reason: str) -> bool:
    """A fault that only reports a peer closing its edge: the echo of a fault elsewhere."""
    return "EdgeClosed" in reason


class PromptRejection(StrEnum):
    """Typed rejections of ``submit_prompt`` (DECISIONS 9)."""

    NOT_PROMPT_READY = ErrorType.RUN_NOT_PROMPT_READY.value
    SHUTTING_DOWN = ErrorType.RUN_SHUTTING_DOWN.value
    DUPLICATE_REQUEST_ID = ErrorType.DUPLICATE_REQUEST_ID.value
    QUEUE_FULL = ErrorType.PROMPT_QUEUE_FULL.value
    ROLLING_OVER = ErrorType.RUN_ROLLING_OVER.value


REJECTION_TEXT = {
    PromptRejection.NOT_PROMPT_READY: "the run is not prompt-ready",
    PromptRejection.SHUTTING_DOWN: "the run is shutting down",
    PromptRejection.DUPLICATE_REQUEST_ID: "a prompt with this request_id is active or pending",
    PromptRejection.QUEUE_FULL: "the prompt queue is full",
    PromptRejection.ROLLING_OVER: "the run is rolling over (continue-as-new); retry shortly",
}


class NodeCondition(StrEnum):
    """Where a node is (NodeState.condition)."""

    PLANNED = "planned"  # in the plan, no start asked for yet
    STARTING = "starting"  # the provider was asked to start it
    LAUNCHED = "launched"  # the provider started it (a handle), no runtime report yet
    RUNTIME_READY = "runtime_ready"  # NodeRuntimeReady accepted
    JOINED = "joined"  # the run acknowledged its runtime readiness
    LOADING = "loading"  # its stage was provisioned; weights or the stage not ready yet
    READY = "ready"  # weights loaded and stage ready
    FAULTED = "faulted"  # its stage reported a fault (StageFault): it takes no new work
    STOPPING = "stopping"  # StopRun was sent, its StageStopped not seen yet
    STAGE_STOPPED = "stage_stopped"  # StopRun answered
    STOPPED = "stopped"  # the provider stopped the node, or it ended after its stage
    EXITED = "exited"  # the node's process went away on its own, its stage not stopped
    LOST = "lost"  # its membership lease was lost


class NodeState(BaseModel):
    node_id: int
    stage_index: int
    task_queue: str
    readiness_id: str
    runtime_ready: NodeRuntimeReady | None = None
    lease_started: bool = False
    lease_lost: bool = False
    route_owned: bool = False
    route_failed: str | None = None  # a route check that found another owner: why
    acked: bool = False
    stage_provisioned: bool = False
    weights_ready: bool = False
    stage_ready: bool = False
    stage_stopped: bool = False
    stage_faulted: bool = False  # a StageFault of this stage was taken (not an echo)
    stop_sent: bool = False  # the run sent its StopRun
    exited: bool = False
    handle: NodeHandle | None = None
    start_attempted: bool = False
    provider_stopped: bool = False

    def condition(self, *, launched: bool = False, runtime_ready: bool = False) -> NodeCondition:
        """Where the node is, from the run's own facts about it (latest first wins): the
        dashboard's stage state and the ``mvp.run.nodes`` metric's ``state``. ``launched``
        and ``runtime_ready`` count as the handle and the runtime report (what a reader of
        the run's datastream learnt before its snapshot showed them)."""
        if self.provider_stopped or (self.exited and self.stage_stopped):
            return NodeCondition.STOPPED  # a node may end on its own once its stage stopped
        if self.exited:
            return NodeCondition.EXITED
        if self.stage_stopped:
            return NodeCondition.STAGE_STOPPED
        if self.stop_sent:
            return NodeCondition.STOPPING
        if self.stage_faulted:
            return NodeCondition.FAULTED
        if self.lease_lost:
            return NodeCondition.LOST
        if self.weights_ready and self.stage_ready:
            return NodeCondition.READY
        if self.stage_provisioned:
            return NodeCondition.LOADING
        if self.acked:
            return NodeCondition.JOINED
        if self.runtime_ready is not None or runtime_ready:
            return NodeCondition.RUNTIME_READY
        if self.handle is not None or launched:
            return NodeCondition.LAUNCHED
        if self.start_attempted:
            return NodeCondition.STARTING
        return NodeCondition.PLANNED


NODE_CONDITIONS = tuple(c.value for c in NodeCondition)


class PromptRecord(BaseModel):
    request_id: int
    workflow_id: str
    active: bool = False
    # A run-hosted prompt's Update (DECISIONS 66): a client re-attaching waits on it.
    update_id: str | None = None


class StageRecovery(BaseModel):
    """One lost node and its replacement (DECISIONS 68), with the instants of each step
    in milliseconds since the epoch, workflow time (None: not reached)."""

    stage_index: int
    lost_node_id: int
    detail: str  # how the loss was seen: the provider watch, or the lease
    lost_at_ms: int  # the run learnt of the loss
    new_node_id: int | None = None
    started_at_ms: int | None = None  # the replacement node's start was asked for
    joined_at_ms: int | None = None  # ... it passed the readiness barrier (ack)
    ready_at_ms: int | None = None  # the run is prompt-ready again on the new pipeline
    epoch: int | None = None  # the pipeline the replacement joined

    def seconds(self, since: int | None, until: int | None) -> float | None:
        return None if since is None or until is None else round((until - since) / 1000, 3)


def prompt_limit(queue_capacity: int, max_active: int) -> int:
    """Prompts a run holds at once (DECISIONS 62): its active ones and the queue behind
    them, which holds ``queue_capacity - 1`` (with one active prompt: the capacity)."""
    return queue_capacity + max_active - 1
