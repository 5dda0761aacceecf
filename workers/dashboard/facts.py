"""The run's facts as its datastream tells them, folded as frames arrive, and laid over the
last snapshot the dashboard read (pure: no I/O).

The datastream carries (DECISIONS 58, mvp_core.host_observe) the run's lifecycle reports
(each with its index among all the run recorded), the provisioning events
(``ProvisionStart``, ``NodeLive``, ``NodeStopped``), membership (``Alive``, ``Dead``),
stage routes and the nodes' bootstrap steps (runtime ready, acknowledged, stage
provisioned, weights loaded). Every one of them is a step a run or node takes once and
never takes back, so the dashboard's state is the snapshot's joined with the stream's:

- a node's condition: each step the snapshot or the stream has seen (``NodeCondition``);
- the lifecycle: the snapshot's reports, then the stream's with a later index (no gap),
  and from those the phase, the prompt counts, ``stopping``, the fault, the finished
  prompts.

What the datastream does not carry (the plan, the prompt queue, hosts and pids, stop and
fault steps of a stage) stays the snapshot's; ``wants_snapshot`` says when a frame told of
one of those having changed (a plan committed, a prompt admitted or ended, a node the
snapshot did not know), so the observer reads the snapshot again then, not on a timer.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mvp_core import datastream as ds
from mvp_core.models import LifecycleKind, LifecycleReport, RunPhase
from mvp_core.run_records import NodeCondition, NodeState
from mvp_core.run_state import RunState

REPORTS_KEPT = 512  # the stream's latest lifecycle reports, by index
NODES_KEPT = 256  # nodes told of (a run has a handful; replacements add one each)

# The phase a lifecycle report leaves the run in (a report of no phase change: absent).
PHASE_OF: dict[LifecycleKind, RunPhase] = {
    LifecycleKind.RUN_ACCEPTED: RunPhase.ACCEPTED,
    LifecycleKind.RUN_REJECTED: RunPhase.REJECTED,
    LifecycleKind.RUN_PLANNING_STARTED: RunPhase.PLANNING,
    LifecycleKind.RUN_PROVISIONING_STARTED: RunPhase.PROVISIONING,
    LifecycleKind.RUN_READINESS_STARTED: RunPhase.READINESS,
    LifecycleKind.RUN_READY: RunPhase.PROMPT_READY,
    LifecycleKind.STAGE_LOST: RunPhase.RECOVERING,
    LifecycleKind.STAGE_REPLACING: RunPhase.RECOVERING,
    LifecycleKind.STAGE_RECOVERED: RunPhase.PROMPT_READY,
    LifecycleKind.RUN_TEARING_DOWN: RunPhase.TEARING_DOWN,
    LifecycleKind.RUN_TORN_DOWN: RunPhase.TORN_DOWN,
}
_STOPPING = frozenset(
    {
        LifecycleKind.RUN_OPERATOR_STOPPED,
        LifecycleKind.RUN_FAULTED,
        LifecycleKind.RUN_TEARING_DOWN,
        LifecycleKind.RUN_TORN_DOWN,
    }
)
# Reports of a change only the snapshot shows: the plan, the prompt queue, a new node.
_ASK_SNAPSHOT = frozenset(
    {
        LifecycleKind.RUN_PLANNING_READY,
        LifecycleKind.PROMPT_ACCEPTED,
        LifecycleKind.PROMPT_COMPLETED,
        LifecycleKind.PROMPT_FAULTED,
        LifecycleKind.PROMPT_CANCELLED,
        LifecycleKind.STAGE_REPLACING,
        LifecycleKind.RUN_TORN_DOWN,
    }
)
# A node's bootstrap step (phase, status) and the NodeState fact it is.
_STEP_OF = {
    (ds.BootstrapPhase.NODE_RUNTIME_READY.value, "observed"): "runtime_ready",
    (ds.BootstrapPhase.RUNTIME_READY_ACK.value, "sent"): "acked",
    (ds.BootstrapPhase.STAGE_PROVISION.value, "sent"): "stage_provisioned",
    (ds.BootstrapPhase.WEIGHTS_LOADED.value, "observed"): "weights_ready",
}


@dataclass
class NodeFacts:
    """A node's steps as the datastream told them."""

    start_attempted: bool = False  # ProvisionStart
    launched: bool = False  # NodeLive (the provider has its handle)
    runtime_ready: bool = False
    lease_started: bool = False  # membership Alive
    lease_lost: bool = False  # membership Dead
    route_owned: bool = False
    acked: bool = False
    stage_provisioned: bool = False
    weights_ready: bool = False
    provider_stopped: bool = False  # NodeStopped
    exited: bool = False  # NodeStopped "exited on its own"


_FLAGS = (
    "start_attempted",
    "lease_started",
    "lease_lost",
    "route_owned",
    "acked",
    "stage_provisioned",
    "weights_ready",
    "provider_stopped",
    "exited",
)


class StreamFacts:
    """The fold of one datastream's frames (see the module doc)."""

    def __init__(self) -> None:
        self.nodes: dict[int, NodeFacts] = {}
        self.reports: OrderedDict[int, LifecycleReport] = OrderedDict()
        self.wants_snapshot = False  # a frame told of what only the snapshot carries

    def absorb(self, channel: str, record: Any) -> bool:
        """Take one record; whether it was a fact of the run's state."""
        if not isinstance(record, dict):
            return False
        if channel == ds.CHANNEL_LIFECYCLE and record.get("type") == "OrchLifecycle":
            return self._report(record)
        if channel == ds.CHANNEL_PROVISIONING_EVENTS and isinstance(record.get("event"), dict):
            return self._event(record["event"])
        if channel == ds.CHANNEL_MEMBERSHIP and record.get("type") == "SwimMembership":
            node = self._node(record.get("node_id"))
            state = record.get("state")
            if node is None or state not in ("Alive", "Dead"):
                return False
            if state == ds.MembershipState.ALIVE.value:
                node.lease_started = True
            else:
                node.lease_lost = True
            return True
        if channel == ds.CHANNEL_STAGE_ROUTE and record.get("type") == "OrchStageRoute":
            node = self._node(record.get("node_id"))
            if node is None or record.get("owned") is not True:
                return False
            node.route_owned = True
            return True
        if channel == ds.CHANNEL_BOOTSTRAP and record.get("type") == "OrchBootstrap":
            step = _STEP_OF.get((str(record.get("phase")), str(record.get("status"))))
            node_id = record.get("node_id")
            if step is None or not node_id:  # node 0: the run's own step
                return False
            node = self._node(node_id)
            if node is None:
                return False
            setattr(node, step, True)
            return True
        return False

    def _event(self, event: dict[str, Any]) -> bool:
        kind = event.get("kind")
        node = self._node(event.get("node_id"))
        if node is None:
            return False
        if kind == ds.ProvisionEventKind.PROVISION_START.value:
            node.start_attempted = True
        elif kind == ds.ProvisionEventKind.NODE_LIVE.value:
            node.launched = True
            self.wants_snapshot = True  # its host and pid are the snapshot's
        elif kind == ds.ProvisionEventKind.NODE_STOPPED.value:
            if event.get("message") == "exited on its own":
                node.exited = True
            else:
                node.provider_stopped = True
        else:
            return False
        return True

    def _node(self, node_id: Any) -> NodeFacts | None:
        if not isinstance(node_id, int) or isinstance(node_id, bool) or node_id < 0:
            return None
        if node_id not in self.nodes and len(self.nodes) >= NODES_KEPT:
            return None  # bounded
        return self.nodes.setdefault(node_id, NodeFacts())

    def _report(self, record: dict[str, Any]) -> bool:
        index = record.get("index")
        try:
            kind = LifecycleKind(str(record.get("kind")))
            report = LifecycleReport(
                kind=kind,
                run_id=int(record.get("run_id") or 0),
                detail=str(record.get("detail") or ""),
                request_id=record.get("request_id"),
            )
        except (ValueError, TypeError):
            return False
        if not isinstance(index, int) or index < 0:
            return False
        self.reports[index] = report
        self.reports.move_to_end(index)
        while len(self.reports) > REPORTS_KEPT:
            self.reports.popitem(last=False)
        if kind in _ASK_SNAPSHOT:
            self.wants_snapshot = True
        return True

    def knows_more_nodes_than(self, state: RunState) -> bool:
        """A node the stream told of and the snapshot does not know (a replacement)."""
        known = {n.node_id for n in (*state.nodes, *state.replaced_nodes)}
        return any(node_id not in known for node_id in self.nodes)


def newer_reports(state: RunState, facts: StreamFacts) -> list[LifecycleReport]:
    """The stream's reports past the snapshot's, in order, up to the first one missing."""
    index = state.lifecycle_recorded or len(state.lifecycle)
    out: list[LifecycleReport] = []
    while (report := facts.reports.get(index)) is not None:
        out.append(report)
        index += 1
    return out


def told_stopping(state: RunState, facts: StreamFacts) -> bool:
    """Whether the stream told of the run stopping (a stop, a fault, its teardown) past
    what ``state`` shows."""
    return any(r.kind in _STOPPING for r in newer_reports(state, facts))


def overlay(state: RunState, facts: StreamFacts) -> RunState:
    """``state`` joined with what the stream told since (a copy; ``state`` is kept)."""
    fresh = newer_reports(state, facts)
    if not fresh:
        return state
    update: dict[str, Any] = {
        "lifecycle": [*state.lifecycle, *fresh],
        "lifecycle_recorded": (state.lifecycle_recorded or len(state.lifecycle)) + len(fresh),
        "prompts_completed": state.prompts_completed
        + sum(r.kind is LifecycleKind.PROMPT_COMPLETED for r in fresh),
        "prompts_faulted": state.prompts_faulted
        + sum(r.kind is LifecycleKind.PROMPT_FAULTED for r in fresh),
        "prompts_cancelled": state.prompts_cancelled
        + sum(r.kind is LifecycleKind.PROMPT_CANCELLED for r in fresh),
    }
    phases = [PHASE_OF[r.kind] for r in fresh if r.kind in PHASE_OF]
    if phases:
        update["phase"] = phases[-1]
    faulted = next((r for r in fresh if r.kind is LifecycleKind.RUN_FAULTED), None)
    if faulted is not None and state.first_fault is None:
        update["first_fault"] = faulted.detail or "the run faulted"
    return state.model_copy(update=update)


def node_condition(
    node: NodeState | None, facts: NodeFacts | None, run_ready: bool
) -> NodeCondition:
    """A node's condition from the snapshot's facts and the stream's, joined (each step
    seen by either); ``run_ready``: the run is prompt-ready (so every stage of it that
    loaded its weights reported StageReady: the run waits for that before RunReady)."""
    if node is None:
        return NodeCondition.PLANNED
    if facts is None:
        return node.condition()
    update: dict[str, Any] = {f: True for f in _FLAGS if getattr(facts, f)}
    joined = node.model_copy(update=update) if update else node
    if run_ready and joined.weights_ready:
        joined = joined.model_copy(update={"stage_ready": True})
    return joined.condition(launched=facts.launched, runtime_ready=facts.runtime_ready)
