"""What the process host observes of its run, as datastream records (pure).

The host polls the run's ``snapshot`` query and publishes what changed between two
snapshots: bootstrap phases (process spec 8.4), the lifecycle (mirrored, each entry
once), provisioning events, membership and stage-route observations. Nothing here is
control: the run decides, the host only records what it saw (spec 9.18).
"""

from __future__ import annotations

from mvp_core import datastream as ds
from mvp_core.datastream import BootstrapStatus, MembershipState, ProvisionEventKind
from mvp_core.models import LifecycleKind, RunPhase
from mvp_core.run_state import NodeState, RunState

Record = tuple[str, ds.JsonRecord]

# Lifecycle kinds that close a bootstrap phase of the host's own.
_PHASE_OF_KIND = {
    LifecycleKind.RUN_PLANNING_STARTED: ("run_plan", BootstrapStatus.STARTED),
    LifecycleKind.RUN_PLANNING_READY: ("run_plan", BootstrapStatus.READY),
    LifecycleKind.RUN_PROVISIONING_STARTED: ("provider_start", BootstrapStatus.STARTED),
    LifecycleKind.RUN_READY: ("weights_loaded", BootstrapStatus.READY),
    LifecycleKind.RUN_TEARING_DOWN: ("provider_stop", BootstrapStatus.STARTED),
    LifecycleKind.RUN_TORN_DOWN: ("provider_stop", BootstrapStatus.READY),
    LifecycleKind.RUN_REJECTED: ("run_plan", BootstrapStatus.FAILED),
}


def _node(prev: RunState | None, node_id: int) -> NodeState | None:
    if prev is None:
        return None
    return next((n for n in prev.nodes if n.node_id == node_id), None)


def observe(prev: RunState | None, cur: RunState, provider: str) -> list[Record]:
    """The records that tell what changed from ``prev`` (None: nothing seen yet) to ``cur``."""
    out: list[Record] = []
    run_id = cur.run_id
    seen = len(prev.lifecycle) if prev is not None else 0
    if len(cur.lifecycle) < seen:  # a trimmed lifecycle (rollover): never publish twice
        seen = len(cur.lifecycle)
    for i, report in enumerate(cur.lifecycle[seen:], start=seen):
        out.append((ds.CHANNEL_LIFECYCLE, ds.lifecycle_record(report, i)))
        phase = _PHASE_OF_KIND.get(report.kind)
        if phase is not None:
            detail = {"detail": report.detail} if report.detail else None
            out.append(
                (ds.CHANNEL_BOOTSTRAP, ds.orch_bootstrap(phase[0], phase[1], run_id, 0, detail))
            )
    for node in cur.nodes:
        out += _observe_node(run_id, node, _node(prev, node.node_id), provider, cur.stopping)
    return out


def prompt_ready(state: RunState) -> bool:
    return state.phase is RunPhase.PROMPT_READY


def _observe_node(
    run_id: int, node: NodeState, before: NodeState | None, provider: str, stopping: bool
) -> list[Record]:
    out: list[Record] = []
    nid = node.node_id

    def boot(phase: str, status: BootstrapStatus, detail: object = None) -> None:
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
        boot("provider_start", BootstrapStatus.STARTED)
    if node.handle is not None and (before is None or before.handle is None):
        event(
            ProvisionEventKind.NODE_LIVE,
            f"{node.handle.resource_name} on {node.handle.address or node.handle.host}",
        )
        boot("provider_start", BootstrapStatus.READY, {"resource": node.handle.resource_name})
    if changed("runtime_ready") and node.runtime_ready is not None:
        boot(
            "node_runtime_ready",
            BootstrapStatus.OBSERVED,
            {"endpoint": node.runtime_ready.endpoint},
        )
    if changed("lease_started"):
        out.append(
            (ds.CHANNEL_MEMBERSHIP, ds.membership_record(run_id, nid, MembershipState.ALIVE))
        )
        boot("node_swim", BootstrapStatus.OBSERVED)
    if changed("lease_lost"):
        out.append((ds.CHANNEL_MEMBERSHIP, ds.membership_record(run_id, nid, MembershipState.DEAD)))
    if changed("route_owned"):
        identity = node.runtime_ready.worker_identity if node.runtime_ready else ""
        out.append(
            (
                ds.CHANNEL_STAGE_ROUTE,
                ds.stage_route_record(
                    run_id, nid, node.stage_index, node.task_queue, identity, True
                ),
            )
        )
        boot("node_route", BootstrapStatus.OBSERVED)
    if changed("acked"):
        boot("runtime_ready_ack", BootstrapStatus.SENT)
    if changed("stage_provisioned"):
        boot("stage_provision", BootstrapStatus.SENT, {"stage_index": node.stage_index})
    if changed("weights_ready"):
        boot("weights_loaded", BootstrapStatus.OBSERVED, {"stage_index": node.stage_index})
    if changed("provider_stopped"):
        event(ProvisionEventKind.NODE_STOPPED)
    if changed("exited") and not stopping:
        event(ProvisionEventKind.PROVISION_FAILED, "node exited")
    return out
