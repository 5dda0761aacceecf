"""What the process host observes of its run, as datastream records (pure).

The host polls the run's ``snapshot`` query and publishes what changed between two
snapshots: bootstrap phases (process spec 8.4), the lifecycle (mirrored, each entry
once), provisioning events, membership and stage-route observations. Nothing here is
control: the run decides, the host only records what it saw (spec 9.18).
"""

from __future__ import annotations

from collections.abc import Callable

from mvp_core import datastream as ds
from mvp_core.datastream import BootstrapPhase, BootstrapStatus, MembershipState, ProvisionEventKind
from mvp_core.models import LifecycleKind, LifecycleReport, RunPhase
from mvp_core.run_records import NodeState
from mvp_core.run_state import RunState

Record = tuple[str, ds.JsonRecord]

# Lifecycle kinds that close a bootstrap phase of the host's own.
_PHASE_OF_KIND = {
    LifecycleKind.RUN_PLANNING_STARTED: (BootstrapPhase.RUN_PLAN, BootstrapStatus.STARTED),
    LifecycleKind.RUN_PLANNING_READY: (BootstrapPhase.RUN_PLAN, BootstrapStatus.READY),
    LifecycleKind.RUN_PROVISIONING_STARTED: (
        BootstrapPhase.PROVIDER_START,
        BootstrapStatus.STARTED,
    ),
    LifecycleKind.RUN_READY: (BootstrapPhase.WEIGHTS_LOADED, BootstrapStatus.READY),
    LifecycleKind.RUN_TEARING_DOWN: (BootstrapPhase.PROVIDER_STOP, BootstrapStatus.STARTED),
    LifecycleKind.RUN_TORN_DOWN: (BootstrapPhase.PROVIDER_STOP, BootstrapStatus.READY),
    LifecycleKind.RUN_REJECTED: (BootstrapPhase.RUN_PLAN, BootstrapStatus.FAILED),
}


def _failed_phase(cur: RunState) -> tuple[BootstrapPhase, BootstrapStatus] | None:
    """The bootstrap phase a startup fault failed in (process spec 10.15: a failure
    record names its phase): from the run's phase at the fault and, in readiness and
    stage provisioning, the first step some node had not passed. None for a fault while
    serving (its RunFaulted report says so)."""
    at = cur.fault_phase
    nodes = sorted(cur.nodes, key=lambda n: n.stage_index)
    failed = BootstrapStatus.FAILED
    if at in (RunPhase.ACCEPTED, RunPhase.PLANNING):
        return BootstrapPhase.RUN_PLAN, failed
    if at is RunPhase.PROVISIONING:
        if all(n.handle is not None for n in nodes):
            return BootstrapPhase.NODE_RUNTIME_READY, failed
        return BootstrapPhase.PROVIDER_START, failed
    if at is RunPhase.READINESS:
        steps: tuple[tuple[BootstrapPhase, Callable[[NodeState], bool]], ...] = (
            (BootstrapPhase.PROVIDER_START, lambda n: n.handle is not None),
            (BootstrapPhase.NODE_RUNTIME_READY, lambda n: n.runtime_ready is not None),
            (BootstrapPhase.NODE_SWIM, lambda n: n.lease_started and not n.lease_lost),
            (BootstrapPhase.NODE_ROUTE, lambda n: n.route_owned),
            (BootstrapPhase.RUNTIME_READY_ACK, lambda n: n.acked),
        )
        for step, passed in steps:
            if not all(passed(n) for n in nodes):
                return step, failed
        return BootstrapPhase.STAGE_PROVISION, failed
    if at is RunPhase.STAGE_PROVISIONING:
        if not all(n.stage_provisioned for n in nodes):
            return BootstrapPhase.STAGE_PROVISION, failed
        return BootstrapPhase.WEIGHTS_LOADED, failed
    return None


def _node(prev: RunState | None, node_id: int) -> NodeState | None:
    if prev is None:
        return None
    return next((n for n in (*prev.nodes, *prev.replaced_nodes) if n.node_id == node_id), None)


def observe(prev: RunState | None, cur: RunState, provider: str) -> list[Record]:
    """The records that tell what changed from ``prev`` (None: nothing seen yet) to ``cur``."""
    run_id = cur.run_id
    nodes: list[Record] = []
    # A node replaced in a stage recovery (DECISIONS 68) is still told: its exit, its stop.
    for node in (*cur.nodes, *cur.replaced_nodes):
        nodes += _observe_node(run_id, node, _node(prev, node.node_id), provider, cur.stopping)
    runs: list[Record] = []
    for index, report in _new_reports(prev, cur):
        runs.append((ds.CHANNEL_LIFECYCLE, ds.lifecycle_record(report, index)))
        phase = _PHASE_OF_KIND.get(report.kind)
        if report.kind is LifecycleKind.RUN_FAULTED:
            phase = _failed_phase(cur)
        if phase is not None:
            key = "error" if phase[1] is BootstrapStatus.FAILED else "detail"
            detail = {key: report.detail} if report.detail else None
            runs.append(
                (ds.CHANNEL_BOOTSTRAP, ds.orch_bootstrap(phase[0], phase[1], run_id, 0, detail))
            )
    # One poll may see several steps at once: publish them in the order they happened,
    # each kind's own order kept (the run's reports as recorded, nodes by their step).
    nodes.sort(key=_rank)
    out: list[Record] = []
    i = 0
    for record in runs:
        while i < len(nodes) and _rank(nodes[i]) < _rank(record):
            out.append(nodes[i])
            i += 1
        out.append(record)
    return out + nodes[i:]


# Where each record falls in a run's story, by the bootstrap phase it belongs to.
_PHASES = tuple(p.value for p in BootstrapPhase if p is not BootstrapPhase.DATASTREAM)
_KIND_RANK = {
    "RunAccepted": 1.0,
    "RunRejected": 2.0,
    "RunPlanningStarted": 2.0,
    "RunPlanningReady": 2.1,
    "RunProvisioningStarted": 2.9,
    "RunReadinessStarted": 3.5,
    "RunReady": 9.5,
    "PromptAccepted": 10.5,
    "PromptCompleted": 10.5,
    "PromptFaulted": 10.5,
    "PromptCancelled": 10.5,
    "StageLost": 10.6,
    "StageReplacing": 10.7,
    "StageRecovered": 10.8,
    "RunOperatorStopped": 12.0,
    "RunFaulted": 12.0,
    "RunTearingDown": 13.0,
    "RunTornDown": 13.5,
}
_EVENT_RANK = {"ProvisionStart": 3.0, "NodeLive": 3.1, "ProvisionFailed": 12.0, "NodeStopped": 13.4}


def _rank(record: Record) -> float:
    channel, body = record
    if channel == ds.CHANNEL_BOOTSTRAP:
        phase = str(body.get("phase"))
        base = float(_PHASES.index(phase)) if phase in _PHASES else 99.0
        # A run-level phase report closes its phase (e.g. weights_loaded ready on RunReady).
        return base + (
            0.5 if body.get("node_id") == 0 and phase == BootstrapPhase.WEIGHTS_LOADED else 0.0
        )
    if channel == ds.CHANNEL_LIFECYCLE:
        return _KIND_RANK.get(str(body.get("kind")), 99.0)
    if channel == ds.CHANNEL_PROVISIONING_EVENTS:
        event = body.get("event")
        return _EVENT_RANK.get(str(event.get("kind")) if isinstance(event, dict) else "", 99.0)
    if channel == ds.CHANNEL_MEMBERSHIP:
        return 5.0
    if channel == ds.CHANNEL_STAGE_ROUTE:
        return 6.0
    return 99.0


def _new_reports(prev: RunState | None, cur: RunState) -> list[tuple[int, LifecycleReport]]:
    """The reports ``cur`` has that ``prev`` had not, each with its index among all the
    reports the run ever recorded (the list keeps only the latest prompt reports, so
    new ones are told by the count, and they are always the last ones)."""
    total = cur.lifecycle_recorded or len(cur.lifecycle)  # 0: a run of an older release
    before = 0 if prev is None else (prev.lifecycle_recorded or len(prev.lifecycle))
    fresh = min(max(total - before, 0), len(cur.lifecycle))
    first = total - fresh
    tail = cur.lifecycle[len(cur.lifecycle) - fresh :] if fresh else []
    return [(first + i, r) for i, r in enumerate(tail)]


def _observe_node(
    run_id: int, node: NodeState, before: NodeState | None, provider: str, stopping: bool
) -> list[Record]:
    out: list[Record] = []
    nid = node.node_id

    def boot(phase: BootstrapPhase, status: BootstrapStatus, detail: object = None) -> None:
        out.append((ds.CHANNEL_BOOTSTRAP, ds.orch_bootstrap(phase, status, run_id, nid, detail)))

    def event(kind: ProvisionEventKind, message: str = "") -> None:
        out.append(
            (
                ds.CHANNEL_PROVISIONING_EVENTS,
                ds.provision_event(run_id, nid, kind, provider, message),
            )
        )

    def changed(field: str) -> bool:
        return bool(getattr(node, field)) and not (before and getattr(before, field))

    if changed("start_attempted"):
        event(ProvisionEventKind.PROVISION_START)
        boot(BootstrapPhase.PROVIDER_START, BootstrapStatus.STARTED)
    if node.handle is not None and (before is None or before.handle is None):
        event(
            ProvisionEventKind.NODE_LIVE,
            f"{node.handle.resource_name} on {node.handle.address or node.handle.host}",
        )
        boot(
            BootstrapPhase.PROVIDER_START,
            BootstrapStatus.READY,
            {"resource": node.handle.resource_name},
        )
    if changed("runtime_ready") and node.runtime_ready is not None:
        boot(
            BootstrapPhase.NODE_RUNTIME_READY,
            BootstrapStatus.OBSERVED,
            {"endpoint": node.runtime_ready.endpoint},
        )
    if changed("lease_started"):
        out.append(
            (ds.CHANNEL_MEMBERSHIP, ds.membership_record(run_id, nid, MembershipState.ALIVE))
        )
        boot(BootstrapPhase.NODE_SWIM, BootstrapStatus.OBSERVED)
    if changed("lease_lost"):
        out.append((ds.CHANNEL_MEMBERSHIP, ds.membership_record(run_id, nid, MembershipState.DEAD)))
    out += _route_records(run_id, node, before)
    if changed("acked"):
        boot(BootstrapPhase.RUNTIME_READY_ACK, BootstrapStatus.SENT)
    if changed("stage_provisioned"):
        boot(
            BootstrapPhase.STAGE_PROVISION, BootstrapStatus.SENT, {"stage_index": node.stage_index}
        )
    if changed("weights_ready"):
        boot(
            BootstrapPhase.WEIGHTS_LOADED,
            BootstrapStatus.OBSERVED,
            {"stage_index": node.stage_index},
        )
    out += _stop_records(run_id, node, before, provider, stopping)
    return out


def _changed(node: NodeState, before: NodeState | None, field: str) -> bool:
    return bool(getattr(node, field)) and not (before and getattr(before, field))


def _route_records(run_id: int, node: NodeState, before: NodeState | None) -> list[Record]:
    """A route check that found the node's worker owning its queue, or another owner."""
    identity = node.runtime_ready.worker_identity if node.runtime_ready else ""
    out: list[Record] = []
    for owned, field in ((True, "route_owned"), (False, "route_failed")):
        if not _changed(node, before, field):
            continue
        why = "" if owned else (node.route_failed or "")
        route = ds.stage_route_record(
            run_id, node.node_id, node.stage_index, node.task_queue, identity, owned, detail=why
        )
        out.append((ds.CHANNEL_STAGE_ROUTE, route))
        status = BootstrapStatus.OBSERVED if owned else BootstrapStatus.FAILED
        detail = None if owned else {"error": why}
        boot = ds.orch_bootstrap(BootstrapPhase.NODE_ROUTE, status, run_id, node.node_id, detail)
        out.append((ds.CHANNEL_BOOTSTRAP, boot))
    return out


def _stop_records(
    run_id: int, node: NodeState, before: NodeState | None, provider: str, stopping: bool
) -> list[Record]:
    """A node stopped by its provider (and, alive until then, leaving the membership),
    or one that exited on its own while the run was not stopping."""
    out: list[Record] = []
    nid = node.node_id
    if _changed(node, before, "provider_stopped"):
        stopped = ds.provision_event(run_id, nid, ProvisionEventKind.NODE_STOPPED, provider, "")
        out.append((ds.CHANNEL_PROVISIONING_EVENTS, stopped))
        if node.lease_started and not node.lease_lost:  # stopped on purpose: it leaves
            out.append(
                (ds.CHANNEL_MEMBERSHIP, ds.membership_record(run_id, nid, MembershipState.LEFT))
            )
    if _changed(node, before, "exited") and not stopping:
        # Process spec 8.9: a provider's Exited is a node-stopped event (its message says
        # the node was not asked to stop); ProvisionFailed is a start that failed.
        kind = ProvisionEventKind.NODE_STOPPED
        out.append(
            (
                ds.CHANNEL_PROVISIONING_EVENTS,
                ds.provision_event(run_id, nid, kind, provider, "exited on its own"),
            )
        )
    return out
