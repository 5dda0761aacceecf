"""RunWorkflow, one test per lifecycle branch, on the time-skipping test server with
every activity mocked by name (tests/helpers/fake_cluster.py).

Each test drives the run only as a client and its nodes do (start input, signals,
updates, queries, activity results) and asserts only what they see (the result or error
type, the snapshot, the lifecycle), so the tests hold while the workflow's insides move.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import (
    WorkflowExecutionStatus,
    WorkflowUpdateFailedError,
    WorkflowUpdateStage,
)
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from mvp_core import names
from mvp_core.errors import ErrorType
from mvp_core.models import (
    CancelPrompt,
    Done,
    Fault,
    GenerateInput,
    PromptOutcome,
    RequestShutdown,
    RunOutcome,
    RunOutcomeKind,
    RunPhase,
    ServedPrompt,
    StageFault,
    SubmitPrompt,
)
from tests.helpers.fake_cluster import (
    FakeCluster,
    echo_generate,
    kinds,
    run_failure,
    snapshot,
    wait_phase,
)

STARTUP = ["RunAccepted", "RunPlanningStarted", "RunPlanningReady", "RunProvisioningStarted"]
READY = [*STARTUP, "RunReadinessStarted", "RunReady"]
TEARDOWN = ["RunTearingDown", "RunTornDown"]


async def shut_down(handle: Any) -> RunOutcome:
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
    outcome: RunOutcome = await handle.result()
    return outcome


async def test_a_request_without_a_model_is_rejected_and_nothing_is_provisioned(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    async with FakeCluster(env.client, task_queue).serving() as cluster:
        handle = await cluster.start_run(101, model={})
        kind, message, outcome = await run_failure(handle)
    assert kind == ErrorType.RUN_REJECTED
    assert "model source" in message
    assert outcome.outcome is RunOutcomeKind.REJECTED
    assert kinds(outcome) == ["RunRejected"]
    assert cluster.calls == []


async def test_a_planning_fault_rejects_the_run_before_any_node_starts(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    cluster = FakeCluster(
        env.client, task_queue, plan_error="GGUF /models/x.gguf declares 0 layers"
    )
    async with cluster.serving():
        handle = await cluster.start_run(102)
        kind, message, outcome = await run_failure(handle)
    assert kind == ErrorType.RUN_REJECTED
    assert message == "planning failed: GGUF /models/x.gguf declares 0 layers"
    assert kinds(outcome) == ["RunAccepted", "RunPlanningStarted", "RunRejected"]
    assert cluster.calls == ["plan"]


async def test_a_provisioning_fault_faults_the_run_and_stops_the_node_it_tried(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    cluster = FakeCluster(env.client, task_queue, start_error="no free port")
    async with cluster.serving():
        handle = await cluster.start_run(103)
        kind, message, outcome = await run_failure(handle)
    assert kind == ErrorType.RUN_FAULTED
    assert message == "startup (provisioning): no free port"
    assert kinds(outcome) == [*STARTUP, "RunFaulted", *TEARDOWN]
    # A start that failed may have launched its node: teardown stops it by its name.
    assert cluster.calls == ["plan", "start node 1", "stop node 1"]


async def test_a_later_nodes_start_failure_faults_once_and_stops_the_nodes_already_started(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    """Actor spec 12.6 with a stub provider: the second of 3 nodes (ids 2-4) fails to start
    after the first started. One fault names it; the first and the node that failed (a
    failed start may have launched it) are stopped; the third is never started, so never
    stopped."""
    cluster = FakeCluster(env.client, task_queue, start_errors={3: "no GPU on this host"})
    async with cluster.serving():
        handle = await cluster.start_run(144, pipeline_stages=3)
        kind, message, outcome = await run_failure(handle)
        final = await snapshot(handle)
    assert kind == ErrorType.RUN_FAULTED
    assert message == "startup (provisioning): no GPU on this host"
    assert kinds(outcome) == [*STARTUP, "RunFaulted", *TEARDOWN]
    assert cluster.calls[:3] == ["plan", "start node 2", "start node 3"]
    assert sorted(cluster.calls[3:]) == ["stop node 2", "stop node 3"]
    assert final.phase is RunPhase.TORN_DOWN


async def test_a_node_that_never_reports_runtime_ready_faults_readiness_at_its_deadline(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    # The provider watch runs from here on, and the test server skips no time while an
    # activity runs: a short deadline keeps the test fast.
    cluster = FakeCluster(env.client, task_queue, silent_nodes={1})
    async with cluster.serving():
        handle = await cluster.start_run(104, timeouts={"readiness_s": 0.3})
        kind, message, outcome = await run_failure(handle)
    assert kind == ErrorType.RUN_FAULTED
    assert message == (
        "startup (readiness): RuntimeError: node 1 did not report NodeRuntimeReady in time"
    )
    assert kinds(outcome) == [*STARTUP, "RunReadinessStarted", "RunFaulted", *TEARDOWN]
    assert "ack 1" not in cluster.calls and "provision stage 0" not in cluster.calls
    assert cluster.calls[-1] == "stop node 1"


async def test_a_route_owned_by_another_worker_faults_readiness(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    cluster = FakeCluster(env.client, task_queue, route_owner="stale-node@elsewhere")
    async with cluster.serving():
        handle = await cluster.start_run(105)
        kind, message, _ = await run_failure(handle)
    assert kind == ErrorType.RUN_FAULTED
    assert message.startswith("startup (readiness): ")
    assert "route owner of mvp-node-105-1-" in message
    assert "does not match node 1" in message and "stale-node@elsewhere" in message
    assert "ack 1" not in cluster.calls


async def test_a_weight_load_fault_faults_stage_provisioning(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    cluster = FakeCluster(env.client, task_queue, stage_load_error="bad tensor blk.3.attn_q")
    async with cluster.serving():
        handle = await cluster.start_run(106)
        kind, message, outcome = await run_failure(handle)
    assert kind == ErrorType.RUN_FAULTED
    assert message == (
        "startup (stage_provisioning): stage 0 weight load failed: bad tensor blk.3.attn_q"
    )
    assert "RunReady" not in kinds(outcome)
    # The stage was provisioned: it gets its StopRun, then its node the provider's stop.
    assert cluster.calls[-2:] == ["stop stage 0", "stop node 1"]


async def test_a_stage_fault_while_prompt_ready_faults_the_run_after_the_culprit_grace(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    async with FakeCluster(env.client, task_queue).serving() as cluster:
        handle = await cluster.start_run(107)
        state = await wait_phase(handle, RunPhase.PROMPT_READY)
        head = state.nodes[0]
        await handle.signal(
            names.SIGNAL_STAGE_FAULT,
            StageFault(
                run_id=107,
                stage_index=0,
                reason="ring overrun on edge 2",
                readiness_id=head.readiness_id,
            ),
        )
        # No node is found gone within the grace (workflow time, skipped): the report
        # becomes the run's fault.
        kind, message, outcome = await run_failure(handle)
    assert kind == ErrorType.RUN_FAULTED
    assert message == "prompt serving: stage 0 fault: ring overrun on edge 2"
    assert kinds(outcome) == [*READY, "RunFaulted", *TEARDOWN]
    assert cluster.calls[-2:] == ["stop stage 0", "stop node 1"]


@pytest.mark.parametrize(
    ("step", "phase", "started"),
    [
        ("plan", RunPhase.PLANNING, False),
        ("start_node", RunPhase.PROVISIONING, True),
        ("provision_stage", RunPhase.STAGE_PROVISIONING, True),
    ],
)
async def test_a_shutdown_while_a_startup_step_is_in_flight_stops_the_run(
    env: WorkflowEnvironment, task_queue: str, step: str, phase: RunPhase, started: bool
) -> None:
    run_id = 110 + list(RunPhase).index(phase)
    cluster = FakeCluster(env.client, task_queue)
    release = cluster.hold(step)
    async with cluster.serving():
        handle = await cluster.start_run(run_id)
        await cluster.reached_step(step)
        assert (await snapshot(handle)).phase is phase
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
        if step == "start_node":
            # A start in flight runs to its end, so that teardown knows the node it made.
            await wait_phase(handle, RunPhase.PROVISIONING)
            release.set()
        outcome = await handle.result()
        release.set()
    assert outcome.outcome is RunOutcomeKind.OPERATOR_STOPPED
    assert outcome.first_fault is None and outcome.first_stop_error is None
    lifecycle = kinds(outcome)
    assert "RunReady" not in lifecycle
    assert lifecycle[-3:] == ["RunOperatorStopped", *TEARDOWN]
    assert ("stop node 1" in cluster.calls) is started
    assert ("stop stage 0" in cluster.calls) is (step == "provision_stage")


async def test_a_node_that_never_answers_the_ack_is_a_startup_fault_of_readiness(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    """Actor spec 9.2 (runtime-ready acknowledgement timeout): the ack is resent every
    ack_resend_s until ack_s; a node that answers none of them faults the run in
    readiness, naming the activity that timed out, and the started node is stopped."""
    cluster = FakeCluster(env.client, task_queue)
    release = cluster.hold("runtime_ready_ack")
    async with cluster.serving():
        handle = await cluster.start_run(125, timeouts={"ack_s": 4, "ack_resend_s": 1})
        kind, message, outcome = await run_failure(handle)
        release.set()
    assert kind == "RunFaulted", kind
    assert message.startswith("startup (readiness): "), message
    assert "activity node.runtime_ready_ack timed out" in message, message
    assert cluster.calls.count("ack 1") >= 2  # resent before it gave up
    assert "provision stage 0" not in cluster.calls and "stop node 1" in cluster.calls
    assert kinds(outcome)[-3:] == ["RunFaulted", *TEARDOWN]


async def test_a_shutdown_during_readiness_stops_the_started_node(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    cluster = FakeCluster(env.client, task_queue, silent_nodes={1})
    async with cluster.serving():
        handle = await cluster.start_run(120)
        await wait_phase(handle, RunPhase.READINESS)
        outcome = await shut_down(handle)
    assert outcome.outcome is RunOutcomeKind.OPERATOR_STOPPED
    assert kinds(outcome) == [
        *STARTUP,
        "RunReadinessStarted",
        "RunOperatorStopped",
        *TEARDOWN,
    ]
    assert cluster.calls == ["plan", "start node 1", "stop node 1"]


async def test_a_shutdown_while_prompt_ready_stops_every_stage_then_every_node(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    async with FakeCluster(env.client, task_queue).serving() as cluster:
        handle = await cluster.start_run(121, pipeline_stages=2)
        state = await wait_phase(handle, RunPhase.PROMPT_READY)
        assert [n.condition().value for n in state.nodes] == ["ready", "ready"]
        outcome = await shut_down(handle)
        final = await snapshot(handle)
    assert outcome.outcome is RunOutcomeKind.OPERATOR_STOPPED
    assert kinds(outcome) == [*READY, "RunOperatorStopped", *TEARDOWN]
    stops = cluster.calls[-4:]
    assert sorted(stops[:2]) == ["stop stage 0", "stop stage 1"]
    assert sorted(stops[2:]) == ["stop node 2", "stop node 3"]
    assert final.phase is RunPhase.TORN_DOWN
    assert final.token_endpoints_stopped


async def test_shutdown_and_wait_answers_once_the_run_has_closed(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    """The Update returns with the workflow's completion, after the datastream's end: a
    caller that stops its worker next leaves no run open."""
    async with FakeCluster(env.client, task_queue).serving() as cluster:
        handle = await cluster.start_run(126)
        await wait_phase(handle, RunPhase.PROMPT_READY)
        outcome = await handle.execute_update(
            names.UPDATE_SHUTDOWN_AND_WAIT, RequestShutdown(), result_type=RunOutcome
        )
        desc = await handle.describe()
    assert outcome.outcome is RunOutcomeKind.OPERATOR_STOPPED
    assert desc.status is WorkflowExecutionStatus.COMPLETED
    assert cluster.datastreams_ended == [126]


async def test_a_provider_stop_that_fails_in_teardown_is_a_stop_failed_run(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    """Teardown's own fault: the operator stop completes its teardown, but a node the
    provider could not stop makes the run RunStopFailed, naming the node (spec 10.13)."""
    cluster = FakeCluster(env.client, task_queue, stop_node_error="destroy refused")
    async with cluster.serving():
        handle = await cluster.start_run(127)
        await wait_phase(handle, RunPhase.PROMPT_READY)
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
        kind, message, outcome = await run_failure(handle)
        final = await snapshot(handle)
    assert kind == ErrorType.RUN_STOP_FAILED
    assert "provider stop node 1: destroy refused" in message
    assert outcome.outcome is RunOutcomeKind.OPERATOR_STOPPED
    assert final.phase is RunPhase.TORN_DOWN
    assert kinds(outcome)[-2:] == TEARDOWN
    assert cluster.calls[-2:] == ["stop stage 0", "stop node 1"]


async def test_bootstrap_completes_once_for_every_acknowledged_node_and_its_failure_is_no_fault(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    """Process spec 7.6: after every node's runtime-ready acknowledgement, and before any
    stage is provisioned, the provider completes each node's bootstrap, once; a node
    whose completion fails (a rented host's file not removed) still serves."""
    cluster = FakeCluster(env.client, task_queue, bootstrap_errors={3: "ssh: connection reset"})
    async with cluster.serving():
        handle = await cluster.start_run(146, pipeline_stages=2)
        await wait_phase(handle, RunPhase.PROMPT_READY)
        outcome = await shut_down(handle)
    assert outcome.outcome is RunOutcomeKind.OPERATOR_STOPPED
    assert cluster.bootstrapped == [2, 3]
    at = cluster.calls.index("complete bootstrap 2,3")
    assert cluster.calls[:at] == ["plan", "start node 2", "start node 3", "ack 2", "ack 3"]
    assert cluster.calls[at + 1].startswith("provision stage")


async def test_a_failing_stop_among_several_keeps_the_first_error_and_stops_every_node(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    """Actor spec 12.6: the provider stops of the first and last of 3 nodes (ids 2-4) fail,
    the last's answer last. Every node's stop is tried, and the run's stop failure is the
    first error (node 2's), not the last."""
    cluster = FakeCluster(
        env.client,
        task_queue,
        stop_node_errors={2: "destroy refused", 4: "instance API timed out"},
        stop_node_delays={4: 0.5},
    )
    async with cluster.serving():
        handle = await cluster.start_run(145, pipeline_stages=3)
        await wait_phase(handle, RunPhase.PROMPT_READY)
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
        kind, message, outcome = await run_failure(handle)
        final = await snapshot(handle)
    assert kind == ErrorType.RUN_STOP_FAILED
    assert "provider stop node 2: destroy refused" in message
    assert "node 4" not in message
    assert outcome.outcome is RunOutcomeKind.OPERATOR_STOPPED
    assert final.phase is RunPhase.TORN_DOWN
    assert sorted(c for c in cluster.calls if c.startswith("stop node")) == [
        "stop node 2",
        "stop node 3",
        "stop node 4",
    ]


async def test_a_prompt_is_served_to_done_and_counted(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    async with FakeCluster(env.client, task_queue).serving() as cluster:
        handle = await cluster.start_run(122)
        await wait_phase(handle, RunPhase.PROMPT_READY)
        done = await handle.execute_update(
            names.UPDATE_SUBMIT_PROMPT,
            SubmitPrompt(request_id=7, prompt_text="abc", max_tokens=3),
            result_type=Done,
        )
        state = await snapshot(handle)
        outcome = await shut_down(handle)
    assert done == Done(
        request_id=7, final_text="cba", tokens_generated=3, elapsed_ms=1, stop_reason="max_tokens"
    )
    assert state.prompts_completed == 1 and state.active is None and not state.pending
    assert "generate 7" in cluster.calls
    assert kinds(outcome) == [
        *READY,
        "PromptAccepted",
        "PromptCompleted",
        "RunOperatorStopped",
        *TEARDOWN,
    ]
    assert outcome.prompts_completed == 1


async def test_a_prompt_before_prompt_ready_is_rejected_by_type(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    cluster = FakeCluster(env.client, task_queue)
    release = cluster.hold("plan")
    async with cluster.serving():
        handle = await cluster.start_run(123)
        await cluster.reached_step("plan")
        with pytest.raises(WorkflowUpdateFailedError) as caught:
            await handle.execute_update(
                names.UPDATE_SUBMIT_PROMPT,
                SubmitPrompt(request_id=1, prompt_text="too soon"),
                result_type=Done,
            )
        release.set()
        await wait_phase(handle, RunPhase.PROMPT_READY)
        await shut_down(handle)
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == ErrorType.RUN_NOT_PROMPT_READY
    assert "phase planning" in cause.message


async def test_a_prompt_whose_generate_fails_ends_in_its_fault_and_faults_the_run(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    async def broken(inp: Any) -> Any:
        raise ApplicationError(
            "engine fault on stage 0: RuntimeError: boom",
            type=ErrorType.ENGINE_FAULT,
            non_retryable=True,
        )

    async with FakeCluster(env.client, task_queue, generate=broken).serving() as cluster:
        handle = await cluster.start_run(124)
        await wait_phase(handle, RunPhase.PROMPT_READY)
        fault = await handle.execute_update(
            names.UPDATE_SUBMIT_PROMPT,
            SubmitPrompt(request_id=9, prompt_text="x"),
            result_type=Fault,
        )
        kind, message, outcome = await run_failure(handle)
    assert fault.error == "prompt serving fault: engine fault on stage 0: RuntimeError: boom"
    assert kind == ErrorType.RUN_FAULTED
    assert message.startswith("prompt serving: generate on mvp-node-124-1-")
    assert outcome.prompts_faulted == 1


@pytest.mark.parametrize("host", ["workflow", "run"])
async def test_prompts_up_to_max_active_generate_at_once_with_the_queue_behind_them(
    env: WorkflowEnvironment, task_queue: str, host: str
) -> None:
    """max_active_prompts (DECISIONS 62): 3 generate at once, the 4th waits its turn in
    the queue behind them (prompt_queue_capacity - 1 = 1 place), a 5th is QueueFull; each
    ends with its own text and the queue moves on as one finishes. The same whether each
    prompt has its workflow or the run serves it (DECISIONS 66)."""
    started: list[int] = []
    release: dict[int, asyncio.Event] = {}

    async def gated(inp: GenerateInput) -> PromptOutcome:
        rid = inp.prompt.request_id
        started.append(rid)
        gate = release.setdefault(rid, asyncio.Event())
        while not gate.is_set():
            activity.heartbeat()
            try:
                await asyncio.wait_for(gate.wait(), 0.05)
            except TimeoutError:
                pass
        return await echo_generate(inp)

    async def until(cond: Any, what: str) -> None:
        for _ in range(400):
            if cond():
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"not seen: {what}")

    async with FakeCluster(env.client, task_queue, generate=gated).serving() as cluster:
        handle = await cluster.start_run(
            140 if host == "workflow" else 142,
            max_active_prompts=3,
            prompt_queue_capacity=2,
            prompt_host=host,
        )
        await wait_phase(handle, RunPhase.PROMPT_READY)
        updates = [
            await handle.start_update(
                names.UPDATE_SUBMIT_PROMPT,
                SubmitPrompt(request_id=rid, prompt_text=f"p{rid}", max_tokens=2),
                wait_for_stage=WorkflowUpdateStage.ACCEPTED,
                result_type=Done,
            )
            for rid in (1, 2, 3, 4)
        ]
        await until(lambda: len(started) == 3, "three prompts generating")
        state = await snapshot(handle)
        with pytest.raises(WorkflowUpdateFailedError) as full:
            await handle.execute_update(
                names.UPDATE_SUBMIT_PROMPT,
                SubmitPrompt(request_id=5, prompt_text="p5"),
                result_type=Done,
            )
        assert sorted(started) == [1, 2, 3]
        release.setdefault(2, asyncio.Event()).set()  # one finishes: the 4th starts
        await until(lambda: 4 in started, "the queued prompt starting")
        for rid in (1, 3, 4):
            release.setdefault(rid, asyncio.Event()).set()
        results = [await u.result() for u in updates]
        after = await snapshot(handle)
        await shut_down(handle)
    assert [p.request_id for p in state.actives()] == [1, 2, 3]
    assert [p.request_id for p in state.pending] == [4]
    cause = full.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == ErrorType.PROMPT_QUEUE_FULL
    assert [r.final_text for r in results] == ["1p", "2p", "3p", "4p"]
    assert after.prompts_completed == 4 and after.actives() == [] and not after.pending


async def test_run_hosted_prompts_cancelled_queued_and_at_shutdown_end_once_and_are_kept(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    """DECISIONS 66: a run-hosted prompt cancelled in the queue never generates; one
    generating when the run shuts down ends cancelled; each has one end, which the run
    keeps (``prompt_served``). (That no prompt workflow starts: the integration test, on a
    server with visibility.)"""
    started: list[int] = []

    async def held(inp: GenerateInput) -> PromptOutcome:
        assert inp.temporal_text is False
        started.append(inp.prompt.request_id)
        while True:  # until cancelled (the run's shutdown)
            activity.heartbeat()
            await asyncio.sleep(0.05)

    async with FakeCluster(env.client, task_queue, generate=held).serving() as cluster:
        handle = await cluster.start_run(141, prompt_queue_capacity=3, prompt_host="run")
        await wait_phase(handle, RunPhase.PROMPT_READY)
        updates = [
            await handle.start_update(
                names.UPDATE_SUBMIT_PROMPT,
                SubmitPrompt(request_id=rid, prompt_text=f"p{rid}"),
                wait_for_stage=WorkflowUpdateStage.ACCEPTED,
                result_type=Fault,
            )
            for rid in (1, 2)
        ]
        for _ in range(400):
            if started:
                break
            await asyncio.sleep(0.025)
        await handle.signal(names.SIGNAL_CANCEL_PROMPT, CancelPrompt(request_id=2))
        queued = await updates[1].result()
        kept = await handle.query(names.QUERY_PROMPT_SERVED, 2, result_type=ServedPrompt)
        state = await snapshot(handle)
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
        active = await updates[0].result()
        outcome: RunOutcome = await handle.result()
        none = await handle.query(names.QUERY_PROMPT_SERVED, 9, result_type=ServedPrompt)
    assert started == [1]
    assert queued == Fault(request_id=2, error="cancelled")
    assert kept.outcome.terminal == queued and kept.outcome.status.value == "cancelled"
    assert state.prompt_host.value == "run" and [p.request_id for p in state.actives()] == [1]
    assert state.actives()[0].update_id == updates[0].id
    assert active.request_id == 1 and active.error == "run is shutting down"
    assert none is None
    # Cancelled, not faulted (DECISIONS 98): the client's cancel, then the shutdown's.
    assert prompt_ends(outcome) == [
        ("PromptCancelled", "cancelled", 2),
        ("PromptCancelled", "run is shutting down", 1),
    ]
    assert (outcome.prompts_cancelled, outcome.prompts_faulted) == (2, 0)


def prompt_ends(outcome: RunOutcome) -> list[tuple[str, str, int | None]]:
    ends = ("PromptCompleted", "PromptFaulted", "PromptCancelled")
    return [(r.kind.value, r.detail, r.request_id) for r in outcome.lifecycle if r.kind in ends]


async def test_a_prompt_its_client_cancels_is_recorded_cancelled_not_faulted(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    """DECISIONS 98: a generating prompt (in its own PromptWorkflow) that its client
    cancels ends ``PromptCancelled`` with the reason, counted apart from the faults; a
    fault stays ``PromptFaulted``."""
    started: list[int] = []

    async def held_or_broken(inp: GenerateInput) -> PromptOutcome:
        started.append(inp.prompt.request_id)
        if inp.prompt.prompt_text == "boom":
            return PromptOutcome(terminal=Fault(request_id=inp.prompt.request_id, error="boom"))
        while True:  # until cancelled
            activity.heartbeat()
            await asyncio.sleep(0.05)

    async with FakeCluster(env.client, task_queue, generate=held_or_broken).serving() as cluster:
        handle = await cluster.start_run(147)
        await wait_phase(handle, RunPhase.PROMPT_READY)
        held = await handle.start_update(
            names.UPDATE_SUBMIT_PROMPT,
            SubmitPrompt(request_id=5, prompt_text="p"),
            wait_for_stage=WorkflowUpdateStage.ACCEPTED,
            result_type=Fault,
        )
        for _ in range(400):
            if started:
                break
            await asyncio.sleep(0.025)
        await handle.signal(names.SIGNAL_CANCEL_PROMPT, CancelPrompt(request_id=5))
        cancelled = await held.result()
        broken = await handle.execute_update(
            names.UPDATE_SUBMIT_PROMPT,
            SubmitPrompt(request_id=6, prompt_text="boom"),
            result_type=Fault,
        )
        state = await snapshot(handle)
        outcome = await shut_down(handle)
    assert started == [5, 6] and state.prompt_host.value == "workflow"
    assert cancelled == Fault(request_id=5, error="cancelled") and broken.error == "boom"
    assert prompt_ends(outcome) == [
        ("PromptCancelled", "cancelled", 5),
        ("PromptFaulted", "boom", 6),
    ]
    assert (state.prompts_cancelled, state.prompts_faulted, state.prompts_completed) == (1, 1, 0)
    assert (outcome.prompts_cancelled, outcome.prompts_faulted) == (1, 1)
