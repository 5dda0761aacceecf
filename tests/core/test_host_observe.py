"""What the process host publishes of its run's snapshots (mvp_core/host_observe.py)."""

from __future__ import annotations

from mvp_core import datastream as ds
from mvp_core.host_observe import observe
from mvp_core.models import LifecycleKind, NodeHandle, NodeRuntimeReady, ProviderKind
from mvp_core.run_records import NodeState
from mvp_core.run_state import MAX_PROMPT_REPORTS, RunState


def state() -> RunState:
    return RunState(run_id=7, nonce="ab" * 16, authorized_orchestrator="x")


def node(**flags: object) -> NodeState:
    n = NodeState(node_id=1, stage_index=0, task_queue="q", readiness_id="r")
    for k, v in flags.items():
        setattr(n, k, v)
    return n


def phases(records: list[tuple[str, dict[str, object]]]) -> list[str]:
    return [str(r["phase"]) for c, r in records if c == ds.CHANNEL_BOOTSTRAP]


def test_one_poll_that_sees_the_whole_startup_publishes_it_in_the_order_it_happened():
    cur = state()
    for kind in (
        LifecycleKind.RUN_ACCEPTED,
        LifecycleKind.RUN_PLANNING_STARTED,
        LifecycleKind.RUN_PLANNING_READY,
        LifecycleKind.RUN_PROVISIONING_STARTED,
        LifecycleKind.RUN_READINESS_STARTED,
        LifecycleKind.RUN_READY,
    ):
        cur.record(kind)
    ready = NodeRuntimeReady(
        run_id=7,
        node_id=1,
        stage_index=0,
        endpoint="10.0.0.2:5000",
        node_actor="q",
        worker_identity="w",
        readiness_id="r",
    )
    handle = NodeHandle(
        run_id=7,
        node_id=1,
        provider=ProviderKind.PROCESS,
        host="h",
        resource_name="mvp-7-1-abababab",
    )
    cur.nodes = [
        node(
            start_attempted=True,
            handle=handle,
            runtime_ready=ready,
            lease_started=True,
            route_owned=True,
            acked=True,
            stage_provisioned=True,
            weights_ready=True,
        )
    ]
    got = phases(observe(None, cur, "process"))
    order = [
        "run_plan",
        "provider_start",
        "node_runtime_ready",
        "node_swim",
        "node_route",
        "runtime_ready_ack",
        "stage_provision",
        "weights_loaded",
    ]
    firsts = [got.index(p) for p in order]
    assert firsts == sorted(firsts), got
    assert got[-1] == "weights_loaded"  # the run-level "ready" closes it, after the node's


def test_nothing_is_published_twice_and_a_trimmed_lifecycle_still_yields_new_reports():
    prev = state()
    prev.record(LifecycleKind.RUN_ACCEPTED)
    assert [r["kind"] for c, r in observe(None, prev, "process") if c == ds.CHANNEL_LIFECYCLE] == [
        "RunAccepted"
    ]
    assert observe(prev, prev.model_copy(deep=True), "process") == []
    cur = prev.model_copy(deep=True)
    for i in range(MAX_PROMPT_REPORTS + 40):  # past the trim: the list stops growing
        cur.record(LifecycleKind.PROMPT_ACCEPTED, request_id=i)
    before = cur.model_copy(deep=True)
    cur.record(LifecycleKind.PROMPT_COMPLETED, request_id=999)
    assert len(cur.lifecycle) == len(before.lifecycle)  # trimmed: same length
    fresh = [r for c, r in observe(before, cur, "process") if c == ds.CHANNEL_LIFECYCLE]
    assert [(r["kind"], r["request_id"]) for r in fresh] == [("PromptCompleted", 999)]
    assert fresh[0]["index"] == cur.lifecycle_recorded - 1


def test_a_stage_recovery_tells_the_lost_node_the_replacement_and_the_steps():
    """DECISIONS 68: the lost node's exit and stop, the new node's start, the lifecycle's
    StageLost / StageReplacing / StageRecovered, even when one poll sees it all."""
    from mvp_core.models import NodeLossPolicy, RunPhase

    s = state()
    s.node_loss = NodeLossPolicy.REPLACE
    s.phase = RunPhase.PROMPT_READY
    s.nodes.append(node(start_attempted=True, lease_started=True, handle=_handle(1)))
    before = s.model_copy(deep=True)
    s.on_node_exited(1, "exit code -9", at_ms=1)
    lost, new = s.begin_replacement(2)
    new.start_attempted = True
    lost.provider_stopped = True
    s.next_epoch()
    s.recovered(3)
    records = observe(before, s, "process")
    kinds = [r["kind"] for c, r in records if c == ds.CHANNEL_LIFECYCLE]
    assert kinds == ["StageLost", "StageReplacing", "StageRecovered"]
    events = [
        (r["event"]["node_id"], r["event"]["kind"])
        for c, r in records
        if c == ds.CHANNEL_PROVISIONING_EVENTS
    ]
    # Process spec 8.9: its exit is a NodeStopped (not a failed start), then the
    # provider's stop of what was left is one more.
    assert events.count((1, "NodeStopped")) == 2 and (1, "ProvisionFailed") not in events
    assert (new.node_id, "ProvisionStart") in events
    assert observe(s, s, "process") == []  # nothing twice


def _handle(node_id: int) -> NodeHandle:
    return NodeHandle(
        run_id=7, node_id=node_id, provider=ProviderKind.PROCESS, host="h", resource_name="r"
    )


def _ready(node_id: int = 1) -> NodeRuntimeReady:
    return NodeRuntimeReady(
        run_id=7,
        node_id=node_id,
        stage_index=0,
        endpoint="10.0.0.2:5000",
        node_actor="q",
        worker_identity="w",
        readiness_id="r",
    )


def _failures(records: list[tuple[str, dict[str, object]]]) -> list[tuple[str, object]]:
    return [
        (str(r["phase"]), r.get("detail"))
        for c, r in records
        if c == ds.CHANNEL_BOOTSTRAP and r["status"] == "failed"
    ]


def test_a_startup_fault_is_a_failure_record_of_the_phase_that_failed():
    """Process spec 10.15: the phase that failed, status failed, the run, the error."""
    from mvp_core.models import RunPhase

    cases = [
        (RunPhase.PLANNING, {}, "run_plan"),
        (RunPhase.PROVISIONING, {"start_attempted": True}, "provider_start"),
        (RunPhase.READINESS, {"handle": _handle(1)}, "node_runtime_ready"),
        (RunPhase.READINESS, {"handle": _handle(1), "runtime_ready": _ready()}, "node_swim"),
        (
            RunPhase.READINESS,
            {"handle": _handle(1), "runtime_ready": _ready(), "lease_started": True},
            "node_route",
        ),
        (
            RunPhase.READINESS,
            {
                "handle": _handle(1),
                "runtime_ready": _ready(),
                "lease_started": True,
                "route_owned": True,
            },
            "runtime_ready_ack",
        ),
        (RunPhase.STAGE_PROVISIONING, {"acked": True}, "stage_provision"),
        (RunPhase.STAGE_PROVISIONING, {"stage_provisioned": True}, "weights_loaded"),
    ]
    for phase, flags, failed in cases:
        s = state()
        s.phase = phase
        s.nodes = [node(**flags)]
        before = s.model_copy(deep=True)
        s.fault(f"startup ({phase.value}): boom")
        got = _failures(observe(before, s, "process"))
        assert got == [(failed, {"error": f"startup ({phase.value}): boom"})], (phase, got)
        assert observe(s, s, "process") == []
    # A fault while serving names no bootstrap phase (its RunFaulted says it).
    s = state()
    s.phase = RunPhase.PROMPT_READY
    before = s.model_copy(deep=True)
    s.fault("prompt serving: boom")
    assert _failures(observe(before, s, "process")) == []


def test_a_failed_route_check_and_a_node_that_leaves_are_published():
    s = state()
    s.nodes = [node(handle=_handle(1), runtime_ready=_ready(), lease_started=True)]
    before = s.model_copy(deep=True)
    s.on_route_checked(1, False, "pollers: other-worker")
    records = observe(before, s, "process")
    routes = [r for c, r in records if c == ds.CHANNEL_STAGE_ROUTE]
    assert len(routes) == 1 and routes[0]["status"] == "failed" and not routes[0]["owned"]
    assert routes[0]["detail"] == "pollers: other-worker"
    assert _failures(records) == [("node_route", {"error": "pollers: other-worker"})]
    # Stopped on purpose while alive: NodeStopped, and membership Left.
    before = s.model_copy(deep=True)
    s.nodes[0].provider_stopped = True
    records = observe(before, s, "process")
    members = [r["state"] for c, r in records if c == ds.CHANNEL_MEMBERSHIP]
    assert members == ["Left"]
    # A node whose lease was lost does not leave again.
    s2 = state()
    s2.nodes = [node(lease_started=True, lease_lost=True)]
    before = s2.model_copy(deep=True)
    s2.nodes[0].provider_stopped = True
    assert [c for c, _ in observe(before, s2, "process")] == [ds.CHANNEL_PROVISIONING_EVENTS]
