"""Actor spec 12.4 / 12.5 checks on the pure run state machine."""

import pytest

from mvp_core.models import (
    LeaseStarted,
    LifecycleKind,
    ModelFacts,
    NodeHandle,
    NodeLossPolicy,
    NodeRuntimeReady,
    NodeRuntimeReadyAck,
    ProviderKind,
    RecoverySettings,
    RunOutcomeKind,
    RunPhase,
    ShutdownReason,
    StageFault,
    StageReady,
    StageStopped,
    WeightsReady,
)
from mvp_core.planner import build_plan
from mvp_core.run_records import NodeCondition, NodeState, PromptRejection, prompt_limit
from mvp_core.run_state import RunState

RID = "abcd1234-1-0"


def new_state() -> RunState:
    s = RunState(run_id=7, nonce="abcd1234ffff", authorized_orchestrator="mvp-run-7/abcd1234")
    s.plan = build_plan(
        run_id=7,
        orchestrator_node_id=0,
        base_node_id=1,
        stage_count=1,
        max_context=None,
        facts=ModelFacts(
            architecture="llama",
            name="m",
            block_count=30,
            embedding_length=576,
            context_length=8192,
        ),
        model_path="m",
        tokenizer_path="m",
    )
    s.nodes.append(
        NodeState(node_id=1, stage_index=0, task_queue="mvp-node-7-1-abcd1234", readiness_id=RID)
    )
    return s


def ready_report(**kw) -> NodeRuntimeReady:
    base = dict(
        run_id=7,
        node_id=1,
        stage_index=0,
        endpoint="e",
        node_actor="mvp-node-7-1-abcd1234",
        worker_identity="mvp-node-7-1-abcd1234@h:1",
        readiness_id=RID,
    )
    base.update(kw)
    return NodeRuntimeReady(**base)


def bring_to_prompt_ready(s: RunState) -> None:
    assert s.on_runtime_ready(ready_report())
    assert s.on_lease_started(
        LeaseStarted(run_id=7, node_id=1, readiness_id=RID, worker_identity="x")
    )
    s.on_route_checked(1, True)
    assert s.on_ack(NodeRuntimeReadyAck(run_id=7, node_id=1, stage_index=0, readiness_id=RID))
    s.nodes[0].stage_provisioned = True
    assert s.on_weights_ready(WeightsReady(run_id=7, node_id=1, stage_index=0, readiness_id=RID))
    assert s.on_stage_ready(StageReady(run_id=7, stage_index=0, readiness_id=RID))
    assert s.prompt_ready_allowed()
    s.phase = RunPhase.PROMPT_READY


def test_provisioning_starts_only_after_a_committed_plan():
    s = new_state()
    assert s.may_provision()
    s.plan = None
    assert not s.may_provision()


@pytest.mark.parametrize(
    "change",
    [
        {"run_id": 8},
        {"node_id": 2},
        {"stage_index": 1},
        {"readiness_id": "stale-1-0"},
        {"node_actor": "mvp-node-7-1-00000000"},
    ],
)
def test_mismatched_runtime_ready_reports_do_not_advance(change):
    s = new_state()
    assert not s.on_runtime_ready(ready_report(**change))
    assert s.nodes[0].runtime_ready is None and s.ignored_reports == 1


def test_barrier_needs_report_membership_and_route_ownership():
    s = new_state()
    n = s.nodes[0]
    s.on_runtime_ready(ready_report())
    assert not s.barrier_passed(n)
    s.on_lease_started(LeaseStarted(run_id=7, node_id=1, readiness_id=RID, worker_identity="x"))
    assert not s.barrier_passed(n)  # route not yet owned
    s.on_route_checked(1, True)
    assert s.barrier_passed(n)
    s.on_node_exited(1, "gone")
    assert not s.barrier_passed(n)


def test_ack_before_barrier_is_ignored():
    s = new_state()
    s.on_runtime_ready(ready_report())
    assert not s.on_ack(NodeRuntimeReadyAck(run_id=7, node_id=1, stage_index=0, readiness_id=RID))


def test_stage_readiness_gates_prompt_ready():
    s = new_state()
    s.on_runtime_ready(ready_report())
    s.on_lease_started(LeaseStarted(run_id=7, node_id=1, readiness_id=RID, worker_identity="x"))
    s.on_route_checked(1, True)
    s.on_ack(NodeRuntimeReadyAck(run_id=7, node_id=1, stage_index=0, readiness_id=RID))
    assert not s.prompt_ready_allowed()
    # weights before the stage was provisioned do not count
    assert not s.on_weights_ready(
        WeightsReady(run_id=7, node_id=1, stage_index=0, readiness_id=RID)
    )
    s.nodes[0].stage_provisioned = True
    s.on_weights_ready(WeightsReady(run_id=7, node_id=1, stage_index=0, readiness_id=RID))
    assert not s.prompt_ready_allowed()
    assert not s.on_stage_ready(StageReady(run_id=7, stage_index=0, readiness_id="other"))
    s.on_stage_ready(StageReady(run_id=7, stage_index=0, readiness_id=RID))
    assert s.prompt_ready_allowed()


def test_first_run_fault_is_terminal_and_sticky():
    s = new_state()
    assert s.fault("first")
    assert not s.fault("second")
    assert not s.request_shutdown(ShutdownReason.OPERATOR_REQUESTED)
    assert s.first_fault == "first"
    assert s.outcome().outcome is RunOutcomeKind.FAULTED
    assert [r.kind for r in s.lifecycle].count(LifecycleKind.RUN_FAULTED) == 1


def test_operator_stop_is_terminal_and_distinct_from_fault():
    s = new_state()
    assert s.request_shutdown(ShutdownReason.OPERATOR_REQUESTED)
    assert s.stopping and s.first_fault is None
    assert s.outcome().outcome is RunOutcomeKind.OPERATOR_STOPPED
    assert LifecycleKind.RUN_FAULTED not in [r.kind for r in s.lifecycle]


def test_stage_fault_report_faults_the_run_only_when_it_matches():
    s = new_state()
    assert not s.on_stage_fault(StageFault(run_id=7, stage_index=3, reason="x", readiness_id=RID))
    assert s.first_fault is None
    assert s.ignored[-1].kind == "stage_fault" and "stage 3" in s.ignored[-1].reason
    assert s.nodes[0].condition() is not NodeCondition.FAULTED
    assert s.on_stage_fault(StageFault(run_id=7, stage_index=0, reason="oom", readiness_id=RID))
    # The stage's own state says it (process spec: a faulted stage takes no new work)...
    assert s.nodes[0].condition() is NodeCondition.FAULTED
    # ... then stopping once its StopRun is sent, stage_stopped once answered.
    s.nodes[0].stop_sent = True
    assert s.nodes[0].condition() is NodeCondition.STOPPING
    s.nodes[0].stage_stopped = True
    assert s.nodes[0].condition() is NodeCondition.STAGE_STOPPED
    s.nodes[0].stop_sent = s.nodes[0].stage_stopped = False
    # a survivor's report is suspected first: the grace may find the node that really died
    assert s.first_fault is None and "oom" in (s.suspected_fault or "")
    assert s.admission_rejection(1, 8) is PromptRejection.NOT_PROMPT_READY
    # The rejection says why, not "not prompt-ready ... phase prompt_ready" (a busy CI run
    # saw that contradiction for prompts sent during a fault's grace).
    assert s.rejection_text(PromptRejection.NOT_PROMPT_READY, 1) == (
        f"RunNotPromptReady: the run is faulting ({s.suspected_fault}) "
        f"(request_id 1, run 7, phase {s.phase.value})"
    )
    assert s.confirm_suspected()
    assert "oom" in (s.first_fault or "")


def test_a_node_found_dead_during_the_grace_is_the_first_fault_not_the_survivor():
    s = new_state()
    s.nodes.append(
        NodeState(node_id=2, stage_index=1, task_queue="mvp-node-7-2-abcd1234", readiness_id="r2")
    )
    s.phase = RunPhase.PROMPT_READY
    assert s.on_stage_fault(
        StageFault(run_id=7, stage_index=1, reason="EdgeClosed: edge 2", readiness_id="r2")
    )
    s.on_node_exited(1, "process 123 is gone")
    assert s.first_fault == "prompt serving: node 1 exited: process 123 is gone"
    assert not s.confirm_suspected()  # the echo changes nothing
    assert s.first_fault.startswith("prompt serving: node 1 exited")
    assert [r.kind for r in s.lifecycle].count(LifecycleKind.RUN_FAULTED) == 1


def test_a_fault_after_an_operator_stop_is_a_fact_not_the_outcome():
    s = new_state()
    assert s.request_shutdown(ShutdownReason.OPERATOR_REQUESTED)
    assert not s.fault("prompt serving: node 1 exited")
    assert s.first_fault is None and s.later_faults == ["prompt serving: node 1 exited"]
    out = s.outcome()
    assert out.outcome is RunOutcomeKind.OPERATOR_STOPPED
    assert out.later_faults == ["prompt serving: node 1 exited"]
    assert LifecycleKind.RUN_FAULTED not in [r.kind for r in s.lifecycle]


def test_a_failed_provider_stop_is_kept_apart_from_other_stop_errors():
    s = new_state()
    s.stop_error("StopRun stage 0: timeout")
    assert s.provider_stop_error is None
    s.stop_error("provider stop node 1: survived SIGKILL", provider=True)
    assert s.first_stop_error == "StopRun stage 0: timeout"
    assert s.provider_stop_error == "provider stop node 1: survived SIGKILL"


def test_ignored_inputs_are_counted_and_the_latest_described():
    s = new_state()
    for i in range(40):
        s.ignore("request_shutdown", f"reason {i}")
    assert s.ignored_reports == 40
    assert len(s.ignored) == 16 and s.ignored[-1].reason == "reason 39"


def test_membership_loss_names_the_phase():
    s = new_state()
    s.phase = RunPhase.READINESS
    s.on_lease_lost(1, "heartbeat timeout")
    assert s.first_fault is not None and s.first_fault.startswith("startup (readiness)")
    s2 = new_state()
    bring_to_prompt_ready(s2)
    s2.on_lease_lost(1, "heartbeat timeout")
    assert s2.first_fault is not None and s2.first_fault.startswith("prompt serving")


def test_prompt_queue_admission_rules():
    s = new_state()
    assert s.admission_rejection(1, 8) is PromptRejection.NOT_PROMPT_READY
    assert s.rejection_text(PromptRejection.NOT_PROMPT_READY, 1) == (
        "RunNotPromptReady: the run is not prompt-ready (request_id 1, run 7, phase accepted)"
    )
    bring_to_prompt_ready(s)
    for i in range(8):
        assert s.admission_rejection(i, 8) is None
        s.admit(i, f"wf-{i}")
    assert s.admission_rejection(3, 8) is PromptRejection.DUPLICATE_REQUEST_ID
    assert s.admission_rejection(99, 8) is PromptRejection.QUEUE_FULL
    s.begin_rolling_over()
    assert s.admission_rejection(99, 8) is PromptRejection.ROLLING_OVER


def test_a_prompt_meeting_a_shutdown_is_rejected_as_shutting_down():
    """A shutdown asked for in the same workflow task as a prompt leaves the phase at
    prompt_ready for a moment: the rejection names the shutdown, not readiness."""
    s = new_state()
    bring_to_prompt_ready(s)
    assert s.phase is RunPhase.PROMPT_READY
    s.request_shutdown(ShutdownReason.OPERATOR_REQUESTED)
    assert s.phase is RunPhase.PROMPT_READY  # the workflow moves it on later
    assert s.admission_rejection(1, 8) is PromptRejection.SHUTTING_DOWN
    s.begin_rolling_over()
    assert s.admission_rejection(1, 8) is PromptRejection.SHUTTING_DOWN
    faulted = new_state()
    bring_to_prompt_ready(faulted)
    faulted.fault("boom")
    assert faulted.admission_rejection(1, 8) is PromptRejection.SHUTTING_DOWN


def test_one_active_prompt_fifo_and_ids_reusable_after_end():
    s = new_state()
    bring_to_prompt_ready(s)
    for i in (5, 3, 9):
        s.admit(i, f"wf-{i}")
    first = s.activate_next()
    assert first is not None and first.request_id == 5
    assert s.activate_next() is None  # one active at a time
    s.finish_prompt("wf-5", True, "", 5)
    assert s.admission_rejection(5, 8) is None
    nxt = s.activate_next()
    assert nxt is not None and nxt.request_id == 3
    assert s.prompts_completed == 1


def test_up_to_max_active_prompts_fifo_with_the_queue_behind_them():
    """DECISIONS 62: ``max_active`` prompts generate at once, started in admission order;
    a run holds ``prompt_limit`` prompts in all; the earliest active is ``active``."""
    s = new_state()
    bring_to_prompt_ready(s)
    limit = prompt_limit(2, 3)
    assert limit == 4 and prompt_limit(8, 1) == 8
    for i in (5, 3, 9, 4):
        assert s.admission_rejection(i, limit) is None
        s.admit(i, f"wf-{i}")
    assert s.admission_rejection(7, limit) is PromptRejection.QUEUE_FULL
    assert s.most_active == 0
    started = [s.activate_next(3) for _ in range(4)]
    assert [r.request_id if r else None for r in started] == [5, 3, 9, None]
    assert s.most_active == 3
    assert [p.request_id for p in s.actives()] == [5, 3, 9] and s.active is not None
    assert [p.request_id for p in s.pending] == [4]
    assert s.prompt(9) is not None and s.prompt(9) is s.also_active[-1]
    s.finish_prompt("wf-3", True, "", 3)  # a later one ends first
    assert [p.request_id for p in s.actives()] == [5, 9]
    s.finish_prompt("wf-5", True, "", 5)  # the earliest ends: the next is ``active``
    assert s.active is not None and s.active.request_id == 9 and s.also_active == []
    nxt = s.activate_next(3)
    assert nxt is not None and nxt.request_id == 4
    assert [p.request_id for p in s.actives()] == [9, 4] and s.prompts_in_flight() == 2
    assert s.most_active == 3  # the high-water mark stays


def test_no_activation_while_stopping():
    s = new_state()
    bring_to_prompt_ready(s)
    s.admit(1, "wf-1")
    s.fault("boom")
    assert s.activate_next() is None


def test_teardown_waits_for_every_stage_stop_and_node_stop_and_torn_down_once():
    s = new_state()
    bring_to_prompt_ready(s)
    s.nodes.append(
        NodeState(
            node_id=2, stage_index=1, task_queue="q2", readiness_id="r2", start_attempted=True
        )
    )  # its start never reported back: still stopped, by name
    s.nodes[0].start_attempted = True
    s.nodes[0].handle = NodeHandle(
        run_id=7, node_id=1, provider=ProviderKind.PROCESS, host="h", resource_name="r"
    )
    assert not s.stage_stops_observed()
    assert not s.on_stage_stopped(StageStopped(run_id=7, stage_index=0, readiness_id="x"))
    assert s.on_stage_stopped(StageStopped(run_id=7, stage_index=0, readiness_id=RID))
    assert s.stage_stops_observed()
    assert [n.node_id for n in s.nodes_to_stop()] == [1, 2]  # what teardown stops
    s.nodes[0].provider_stopped = True
    s.nodes[1].provider_stopped = True
    assert s.nodes_to_stop() == []
    assert s.record(LifecycleKind.RUN_TORN_DOWN)
    assert not s.record(LifecycleKind.RUN_TORN_DOWN)


def test_first_stop_error_is_kept():
    s = new_state()
    s.stop_error("a")
    s.stop_error("b")
    assert s.first_stop_error == "a"


def test_lost_nodes_are_skipped_by_stage_stop():
    s = new_state()
    bring_to_prompt_ready(s)
    s.on_node_exited(1, "killed")
    assert s.stages_to_stop() == [] and s.stage_stops_observed()


def test_state_round_trips_as_json_for_continue_as_new():
    s = new_state()
    bring_to_prompt_ready(s)
    s.admit(1, "wf-1")
    again = RunState.model_validate_json(s.model_dump_json())
    assert again == s


def test_prompt_reports_are_bounded_but_run_reports_are_kept():
    from mvp_core.run_state import MAX_PROMPT_REPORTS

    s = new_state()
    bring_to_prompt_ready(s)
    s.record(LifecycleKind.RUN_READY)
    for i in range(MAX_PROMPT_REPORTS):
        s.admit(i, f"wf-{i}")
        s.finish_prompt(f"wf-{i}", True, "", i)
    prompt_reports = [r for r in s.lifecycle if r.kind.value.startswith("Prompt")]
    assert len(prompt_reports) == MAX_PROMPT_REPORTS
    assert prompt_reports[-1].request_id == MAX_PROMPT_REPORTS - 1
    assert LifecycleKind.RUN_READY in [r.kind for r in s.lifecycle]
    assert s.prompts_completed == MAX_PROMPT_REPORTS  # the counters stay exact


def test_a_suspected_echo_gives_way_to_the_report_that_says_why():
    s = new_state()
    s.phase = RunPhase.PROMPT_READY
    assert s.suspect("prompt serving: stage 1 fault: EdgeClosed: edge 2: peer closed")
    assert not s.suspect("prompt serving: stage 0 fault: TokenSequenceError: sequence violation")
    assert not s.suspect("prompt serving: stage 1 fault: EdgeClosed: edge 3: peer closed")
    assert s.confirm_suspected()
    assert s.first_fault is not None and "sequence violation" in s.first_fault
    assert len(s.later_faults) == 2


def test_untrusted_reasons_are_clipped_in_state():
    s = new_state()
    s.ignore("x" * 1000, "y" * 100_000)
    assert len(s.ignored[-1].kind) == 64 and len(s.ignored[-1].reason) == 500
    s.fault("z" * 100_000)
    assert s.first_fault is not None and len(s.first_fault) == 500


# ---------------------------------------------------------------------- stage recovery
def replacing_state(max_replacements: int = 2) -> RunState:
    """A prompt-ready run that replaces lost nodes (DECISIONS 68), at most
    ``max_replacements`` within an hour."""
    s = new_state()
    s.node_loss = NodeLossPolicy.REPLACE
    s.recovery_bound = RecoverySettings(max_replacements=max_replacements, window_s=3600)
    bring_to_prompt_ready(s)
    s.phase = RunPhase.PROMPT_READY
    return s


def test_a_lost_node_is_queued_for_replacement_not_a_fault():
    s = replacing_state()
    s.nodes[0].start_attempted = True
    s.suspect("prompt serving: stage 0 fault: EdgeClosed: peer closed")
    s.on_node_exited(1, "exit code -9", at_ms=1_000)
    assert s.first_fault is None and s.suspected_fault is None  # the loss explains it
    assert s.phase is RunPhase.RECOVERING and [r.lost_node_id for r in s.lost] == [1]
    assert not s.may_activate(4)  # nothing is dispatched while the stage is lost ...
    assert s.admission_rejection(5, 8) is None  # ... but prompts are still queued
    s.on_lease_lost(1, "heartbeat timeout", at_ms=1_500)  # the same loss, seen twice
    assert len(s.lost) == 1 and s.first_fault is None
    lost, node = s.begin_replacement(2_000)
    assert (lost.node_id, node.node_id, node.stage_index) == (1, 2, 0)
    assert node.task_queue == "mvp-node-7-2-abcd1234" and node.readiness_id != lost.readiness_id
    assert s.nodes == [node] and s.replaced_nodes == [lost]
    assert s.plan is not None and s.plan.stages[0].node_id == 2
    # The lost node never rejoins: its reports match no node of the run.
    assert not s.on_stage_ready(StageReady(run_id=7, stage_index=0, readiness_id=RID))
    assert s.nodes_to_stop() == [lost]  # its provider stop is still owed
    node.start_attempted = True
    assert s.nodes_to_stop() == [node, lost]
    assert s.next_epoch() == 1 and not node.stage_ready and not s.token_endpoints_ready
    s.recovered(9_000)
    assert s.phase is RunPhase.PROMPT_READY and s.recovering is None
    rec = s.recoveries[-1]
    assert (rec.stage_index, rec.lost_node_id, rec.new_node_id, rec.epoch) == (0, 1, 2, 1)
    assert rec.seconds(rec.lost_at_ms, rec.ready_at_ms) == 8.0
    kinds = [r.kind for r in s.lifecycle]
    assert kinds[-3:] == [
        LifecycleKind.STAGE_LOST,
        LifecycleKind.STAGE_REPLACING,
        LifecycleKind.STAGE_RECOVERED,
    ]


def test_reports_of_an_earlier_pipeline_move_nothing():
    s = replacing_state()
    s.on_node_exited(1, "gone", at_ms=0)
    s.begin_replacement(1)
    new_rid = s.nodes[0].readiness_id
    s.nodes[0].stage_provisioned = True
    s.next_epoch()
    assert not s.on_stage_ready(StageReady(run_id=7, stage_index=0, readiness_id=new_rid))
    assert not s.nodes[0].stage_ready and "epoch 0" in s.ignored[-1].reason
    assert s.on_stage_ready(StageReady(run_id=7, stage_index=0, readiness_id=new_rid, epoch=1))
    fault = StageFault(run_id=7, stage_index=0, reason="EdgeClosed", readiness_id=new_rid)
    assert not s.on_stage_fault(fault) and s.suspected_fault is None  # of pipeline 0
    # A fault of the new pipeline, once it is wired, is one (the grace, then the fault).
    new = fault.model_copy(update={"epoch": 1, "reason": "EdgeAuthError: rejected"})
    assert s.on_stage_fault(new) and s.suspected_fault is not None
    assert "EdgeAuthError" in s.suspected_fault


def test_a_loss_past_the_bound_or_during_a_recovery_faults_the_run():
    s = replacing_state(max_replacements=1)
    s.on_node_exited(1, "gone", at_ms=0)
    s.begin_replacement(1)
    s.recovered(2)
    s.on_node_exited(2, "gone again", at_ms=10_000)
    assert s.first_fault is not None and "no replacement left: 1 within 3600 s" in s.first_fault
    assert s.first_fault.startswith("prompt serving: node 2 exited")

    s = replacing_state(max_replacements=1)
    s.on_node_exited(1, "gone", at_ms=0)
    s.begin_replacement(1)
    s.recovered(2)
    s.on_node_exited(2, "gone again", at_ms=3_600_001)  # the first is out of the window
    assert s.first_fault is None and s.lost

    s = replacing_state(max_replacements=5)
    s.on_node_exited(1, "gone", at_ms=0)
    s.begin_replacement(1)
    s.on_node_exited(2, "the replacement died", at_ms=5)
    assert s.first_fault is not None and "while stage 0 was being replaced" in s.first_fault


def test_fail_policy_startup_losses_and_stopping_runs_never_replace():
    s = new_state()
    bring_to_prompt_ready(s)
    s.phase = RunPhase.PROMPT_READY
    s.on_node_exited(1, "gone", at_ms=0)
    assert s.first_fault == "prompt serving: node 1 exited: gone" and not s.lost
    s = replacing_state()
    s.phase = RunPhase.STAGE_PROVISIONING
    s.on_node_exited(1, "gone", at_ms=0)
    assert s.first_fault is not None and not s.lost
    s = replacing_state()
    s.request_shutdown(ShutdownReason.OPERATOR_REQUESTED)
    s.on_node_exited(1, "gone", at_ms=0)
    assert s.first_fault is None and not s.lost and s.nodes[0].exited


def test_epoch_edges_have_ids_of_their_own():
    from mvp_core.planner import epoch_edges, plan_edges

    edges = plan_edges(3, 64, 576)
    assert epoch_edges(edges, 0) == edges
    again = epoch_edges(edges, 2)
    assert [e.edge_id & 0xFFFF for e in again] == [e.edge_id for e in edges]
    assert not {e.edge_id for e in again} & {e.edge_id for e in edges}
    assert all(e.edge_id < 2**32 for e in again)


# ---------------------------------------------------------------------- serving decisions
def test_a_prompt_hears_of_its_head_only_when_it_changed_or_is_being_replaced():
    s = replacing_state()
    head_queue = s.head().task_queue
    assert s.head_news(head_queue) is None  # admitted to the head that serves: no news
    s.on_node_exited(1, "exit code -9", at_ms=1_000)
    _lost, node = s.begin_replacement(2_000)
    news = s.head_news(head_queue)
    assert news is not None and not news.ready  # being replaced: wait for the new head
    assert news.node_id == node.node_id and news.task_queue == node.task_queue
    s.recovered(3_000)
    news = s.head_news(head_queue)
    assert news is not None and news.ready and news.task_queue == node.task_queue
    assert s.head_news(node.task_queue) is None


def test_rolling_over_waits_for_prompts_and_recoveries_and_is_never_carried():
    s = replacing_state()
    assert not s.should_roll_over(False)
    assert s.should_roll_over(True)
    s.admit(1, "wf-1")
    s.begin_rolling_over()
    assert not s.should_roll_over(True)  # already rolling over
    assert s.admission_rejection(2, 8) is PromptRejection.ROLLING_OVER
    assert s.serving_phase() is RunPhase.ROLLING_OVER
    assert not s.rolled_over()  # a prompt is still in flight
    s.remove_pending(1)
    assert s.rolled_over()
    s.on_node_exited(1, "exit code -9", at_ms=1_000)
    assert not s.rolled_over()  # a recovery first
    carried = RunState.model_validate(s.model_dump())
    carried.resume_carried()
    assert not carried.rolling_over and carried.continued == s.continued + 1
    assert carried.phase is RunPhase.PROMPT_READY


def test_a_sampled_prompt_gets_a_seed_only_where_lost_nodes_are_replaced():
    assert replacing_state().draws_seed(0.7, None)
    assert not replacing_state().draws_seed(0.7, 42)  # its own seed is kept
    assert not replacing_state().draws_seed(0.0, None)  # greedy: nothing to draw
    assert not new_state().draws_seed(0.7, None)  # fail-stop runs never resume a prompt
