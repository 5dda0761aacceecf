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
    assert (1, "ProvisionFailed") in events and (1, "NodeStopped") in events
    assert (new.node_id, "ProvisionStart") in events
    assert observe(s, s, "process") == []  # nothing twice


def _handle(node_id: int) -> NodeHandle:
    return NodeHandle(
        run_id=7, node_id=node_id, provider=ProviderKind.PROCESS, host="h", resource_name="r"
    )
