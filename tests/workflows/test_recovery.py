"""Stage recovery (``on_node_loss: "replace"``, DECISIONS 68), one test per branch, on
the time-skipping test server with every activity mocked by name
(tests/helpers/fake_cluster.py): a node "dies" (``FakeNode.die``: the provider watch
reports it) or its lease ends (``FakeNode.end_lease``), and the run replaces it, or
faults.

As tests/workflows/test_run_lifecycle.py, each test drives the run only as a client and
its nodes do (start input, signals, updates, queries, activity results) and asserts what
they see: which activities were called with which inputs, the snapshot, the outcome.
(tests/integration/test_recovery.py kills real node processes under streaming prompts.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowHandle, WorkflowUpdateStage
from temporalio.testing import WorkflowEnvironment

from mvp_core import names
from mvp_core.errors import ErrorType
from mvp_core.models import (
    Done,
    GenerateInput,
    PromptOutcome,
    RequestShutdown,
    RunOutcome,
    RunOutcomeKind,
    RunPhase,
    SubmitPrompt,
)
from mvp_core.run_state import RunState
from tests.helpers.fake_cluster import (
    FakeCluster,
    echo_generate,
    kinds,
    run_failure,
    snapshot,
    wait_phase,
)

REPLACE = {"on_node_loss": "replace"}
RECOVERY = ["StageLost", "StageReplacing", "StageRecovered"]
TEARDOWN = ["RunTearingDown", "RunTornDown"]


def exited(node_id: int) -> str:
    """How the run words a node the provider watch found gone (``FakeNode.die``)."""
    return f"node {node_id} exited: process 4242 is gone"


def lease_lost(node_id: int) -> str:
    """... and one whose lease ended (``FakeNode.end_lease``)."""
    return f"membership lost for node {node_id}: lease ended: the node left the run"


async def recovered(
    handle: WorkflowHandle[Any, Any], count: int, timeout: float = 15.0
) -> RunState:
    """Poll the snapshot (real time) until the run has recovered ``count`` times and is
    prompt-ready again."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        state = await snapshot(handle)
        if state.recoveries_done >= count and state.phase is RunPhase.PROMPT_READY:
            return state
        assert state.first_fault is None, state.first_fault
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not recovered {count} time(s): {state}")
        await asyncio.sleep(0.02)


async def shut_down(handle: WorkflowHandle[Any, Any]) -> RunOutcome:
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
    return RunOutcome.model_validate(await handle.result())


def node_stops(cluster: FakeCluster) -> list[str]:
    return sorted(c for c in cluster.calls if c.startswith("stop node"))


def node_starts(cluster: FakeCluster) -> list[str]:
    return [c for c in cluster.calls if c.startswith("start node")]


def all_stopped(state: RunState) -> bool:
    return all(n.provider_stopped for n in (*state.nodes, *state.replaced_nodes))


async def test_a_lost_middle_stage_is_replaced_and_the_run_serves_again(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    """Only the lost stage gets a new node (stopped first, then started through the same
    provider); the survivors keep their stage and layers and join the new pipeline
    (epoch 1), wired to the replacement."""
    async with FakeCluster(env.client, task_queue).serving() as cluster:
        handle = await cluster.start_run(401, pipeline_stages=3, **REPLACE)
        before = await wait_phase(handle, RunPhase.PROMPT_READY)
        # A pipeline's nodes are 2, 3, 4 (node 1 is the orchestrator's: mvp_core.planner).
        assert [(n.node_id, n.stage_index) for n in before.nodes] == [(2, 0), (3, 1), (4, 2)]
        cluster.nodes[3].die()
        after = await recovered(handle, 1)
        done = await handle.execute_update(
            names.UPDATE_SUBMIT_PROMPT,
            SubmitPrompt(request_id=1, prompt_text="abc", max_tokens=3),
            result_type=Done,
        )
        outcome = await shut_down(handle)
        final = await snapshot(handle)

    # The replacement: one new node, for stage 1, started after the lost one's stop.
    assert node_starts(cluster) == [
        "start node 2",
        "start node 3",
        "start node 4",
        "start node 5",
    ]
    assert cluster.calls.index("stop node 3") < cluster.calls.index("start node 5")
    new = after.nodes[1]
    spec = cluster.nodes[5].spec
    assert (new.node_id, new.stage_index) == (5, 1)
    assert (spec.stage_index, spec.task_queue, spec.readiness_id) == (
        1,
        new.task_queue,
        new.readiness_id,
    )
    assert new.task_queue == names.node_task_queue(401, 5, after.nonce)
    # Provisions: the replacement loads stage 1's layers once, on the new pipeline; each
    # survivor gets its own provision again with the new epoch; the lost node no more.
    old_layers = {i: cluster.nodes[i].provisions[0].layers for i in (2, 3, 4)}
    assert [(p.stage_index, p.epoch, p.layers) for p in cluster.nodes[5].provisions] == [
        (1, 1, old_layers[3])
    ]
    for node_id, stage in ((2, 0), (4, 2)):
        provs = cluster.nodes[node_id].provisions
        assert [(p.stage_index, p.epoch, p.layers) for p in provs] == [
            (stage, 0, old_layers[node_id]),
            (stage, 1, old_layers[node_id]),
        ]
    assert [p.epoch for p in cluster.nodes[3].provisions] == [0]
    # The head now sends to the replacement (its endpoint, 17000 + node id).
    head_sends = [p.consumer_endpoint for p in cluster.nodes[2].provisions]
    assert [e.port for e in head_sends if e is not None] == [17003, 17005]
    # The snapshot records the replacement.
    assert after.first_fault is None and after.epoch == 1 and after.recoveries_done == 1
    (rec,) = after.recoveries
    assert (rec.stage_index, rec.lost_node_id, rec.new_node_id, rec.epoch) == (1, 3, 5, 1)
    assert rec.detail == exited(3)
    assert None not in (rec.started_at_ms, rec.joined_at_ms, rec.ready_at_ms)
    assert [n.node_id for n in after.nodes] == [2, 5, 4]
    assert [(n.node_id, n.provider_stopped) for n in after.replaced_nodes] == [(3, True)]
    assert after.plan is not None and [s.node_id for s in after.plan.stages] == [2, 5, 4]
    assert [k for k in kinds(after) if k in RECOVERY or k == "RunFaulted"] == RECOVERY
    # Served on the new pipeline, by the head; then stopped cleanly, every node once.
    assert done.final_text == "cba" and done.recoveries == 0
    assert [node for node, _ in cluster.generates] == [2]
    assert outcome.outcome is RunOutcomeKind.OPERATOR_STOPPED and outcome.first_fault is None
    assert node_stops(cluster) == ["stop node 2", "stop node 3", "stop node 4", "stop node 5"]
    assert all_stopped(final)


@pytest.mark.parametrize(("run_id", "host"), [(402, "workflow"), (403, "run")])
async def test_a_lost_head_is_replaced_and_its_prompts_go_on_on_the_new_head(
    env: WorkflowEnvironment, task_queue: str, run_id: int, host: str
) -> None:
    """The head node dies under a generating prompt: the run tells its prompts the head
    is lost, then which node serves; the prompt generates again on the replacement head,
    and one admitted while the head was being replaced waits for it too (DECISIONS 68,
    in a prompt workflow of its own or served by the run: DECISIONS 66)."""
    first_head: list[str] = []

    async def held_on_the_first_head(inp: GenerateInput) -> PromptOutcome:
        if activity.info().task_queue in first_head:
            while True:  # its node is gone: until the prompt gives up on it
                activity.heartbeat()
                await asyncio.sleep(0.05)
        return await echo_generate(inp)

    cluster = FakeCluster(env.client, task_queue, generate=held_on_the_first_head)
    async with cluster.serving():
        handle = await cluster.start_run(run_id, pipeline_stages=2, prompt_host=host, **REPLACE)
        before = await wait_phase(handle, RunPhase.PROMPT_READY)
        first_head.append(before.nodes[0].task_queue)
        first = await handle.start_update(
            names.UPDATE_SUBMIT_PROMPT,
            SubmitPrompt(request_id=1, prompt_text="abc", max_tokens=3),
            wait_for_stage=WorkflowUpdateStage.ACCEPTED,
            result_type=Done,
        )
        await asyncio.wait_for(cluster.generating.wait(), 10)
        # The replacement's start waits: a prompt comes in while the head is replaced.
        release = cluster.hold("start_node")
        cluster.reached.pop("start_node", None)
        cluster.nodes[2].die()
        await cluster.reached_step("start_node")
        during = await snapshot(handle)
        second = await handle.start_update(
            names.UPDATE_SUBMIT_PROMPT,
            SubmitPrompt(request_id=2, prompt_text="xyz", max_tokens=3),
            wait_for_stage=WorkflowUpdateStage.ACCEPTED,
            result_type=Done,
        )
        release.set()
        dones = [await first.result(), await second.result()]
        after = await recovered(handle, 1)
        outcome = await shut_down(handle)
        final = await snapshot(handle)

    assert during.phase is RunPhase.RECOVERING
    assert during.recovering is not None and during.recovering.stage_index == 0
    # The replacement is the head.
    new_head = after.nodes[0]
    assert (new_head.node_id, new_head.stage_index) == (4, 0)
    assert [n.node_id for n in after.replaced_nodes] == [2]
    assert node_starts(cluster) == ["start node 2", "start node 3", "start node 4"]
    # The first prompt's generate was left on the lost head and scheduled again on the
    # new one (its text regenerated whole: no stream text to skip here); the second went
    # there at once. Each is Done with its text, the first after one recovery.
    served = [(node, inp.prompt.request_id) for node, inp in cluster.generates]
    assert served == [(2, 1), (4, 1), (4, 2)]
    again = cluster.generates[1][1]
    assert again.readiness_id == new_head.readiness_id
    assert again.text_from == 0 and again.resume == [] and again.checkpoint
    assert [(d.request_id, d.final_text, d.recoveries) for d in dones] == [
        (1, "cba", 1),
        (2, "zyx", 0),
    ]
    # The survivor sends to the new head; the new head has the head's recovery wait.
    survivor_sends = cluster.nodes[3].provisions[-1].consumer_endpoint
    assert survivor_sends is not None and survivor_sends.port == 17004
    assert cluster.nodes[4].provisions[-1].recovery_wait_s is not None
    assert outcome.outcome is RunOutcomeKind.OPERATOR_STOPPED
    assert outcome.prompts_completed == 2 and outcome.prompts_faulted == 0
    assert node_stops(cluster) == ["stop node 2", "stop node 3", "stop node 4"]
    assert all_stopped(final)


@pytest.mark.parametrize(
    ("run_id", "failure", "reason"),
    [
        (404, "start", "no free port"),
        (405, "silent", "RuntimeError: node 4 did not report NodeRuntimeReady in time"),
    ],
)
async def test_a_replacement_that_fails_faults_the_run_and_stops_every_node(
    env: WorkflowEnvironment, task_queue: str, run_id: int, failure: str, reason: str
) -> None:
    """The replacement's start fails, or it never reports ready within
    ``recovery.replacement_timeout_s``: the run faults naming the stage and the reason,
    and tears down every node (the lost one, the survivor and the replacement)."""
    cluster = FakeCluster(env.client, task_queue)
    async with cluster.serving():
        handle = await cluster.start_run(
            run_id, pipeline_stages=2, recovery={"replacement_timeout_s": 1.0}, **REPLACE
        )
        await wait_phase(handle, RunPhase.PROMPT_READY)
        if failure == "start":
            cluster.start_error = "no free port"
        else:
            cluster.silent_nodes.add(4)
        cluster.nodes[3].die()
        kind, message, outcome = await run_failure(handle)
        final = await snapshot(handle)
    assert kind == ErrorType.RUN_FAULTED
    assert message == f"prompt serving: recovery of stage 1 failed: {reason}"
    assert outcome.first_fault == message
    lifecycle = kinds(outcome)
    assert "StageRecovered" not in lifecycle and lifecycle.count("RunFaulted") == 1
    assert lifecycle[-3:] == ["RunFaulted", *TEARDOWN]
    assert node_starts(cluster) == ["start node 2", "start node 3", "start node 4"]
    assert node_stops(cluster) == ["stop node 2", "stop node 3", "stop node 4"]
    assert final.phase is RunPhase.TORN_DOWN and final.recoveries_done == 0
    assert all_stopped(final)


async def test_a_loss_past_max_replacements_faults_the_run_naming_the_bound(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    """One replacement allowed (``recovery.max_replacements``): the first loss (a lease
    that ended) is replaced, the second (a node gone) within the window is the run's
    fault, as fail-stop."""
    async with FakeCluster(env.client, task_queue).serving() as cluster:
        handle = await cluster.start_run(
            406, pipeline_stages=2, recovery={"max_replacements": 1}, **REPLACE
        )
        await wait_phase(handle, RunPhase.PROMPT_READY)
        cluster.nodes[3].end_lease()
        after = await recovered(handle, 1)
        assert after.nodes[1].node_id == 4 and after.recoveries[0].detail == lease_lost(3)
        cluster.nodes[4].die()
        kind, message, outcome = await run_failure(handle)
        final = await snapshot(handle)
    assert kind == ErrorType.RUN_FAULTED
    bound = " (no replacement left: 1 within 3600 s)"
    assert message == f"prompt serving: {exited(4)}{bound}"
    lifecycle = kinds(outcome)
    assert lifecycle.count("StageRecovered") == 1 and lifecycle.count("StageReplacing") == 1
    assert lifecycle[-3:] == ["RunFaulted", *TEARDOWN]
    assert node_starts(cluster) == ["start node 2", "start node 3", "start node 4"]
    assert node_stops(cluster) == ["stop node 2", "stop node 3", "stop node 4"]
    assert final.recoveries_done == 1 and all_stopped(final)


@pytest.mark.parametrize(("run_id", "loss"), [(407, "exited"), (408, "lease")])
async def test_by_default_a_lost_node_faults_the_run(
    env: WorkflowEnvironment, task_queue: str, run_id: int, loss: str
) -> None:
    """``on_node_loss: "fail"`` (the default, the specs' fail-stop): the first loss, seen
    by the provider watch or the node's lease, is the run's fault; nothing is replaced."""
    async with FakeCluster(env.client, task_queue).serving() as cluster:
        handle = await cluster.start_run(run_id, pipeline_stages=2)
        before = await wait_phase(handle, RunPhase.PROMPT_READY)
        assert before.node_loss.value == "fail"
        if loss == "exited":
            cluster.nodes[3].die()
        else:
            cluster.nodes[3].end_lease()
        kind, message, outcome = await run_failure(handle)
        final = await snapshot(handle)
    assert kind == ErrorType.RUN_FAULTED
    assert message == f"prompt serving: {exited(3) if loss == 'exited' else lease_lost(3)}"
    lifecycle = kinds(outcome)
    assert not set(RECOVERY) & set(lifecycle)
    assert lifecycle[-3:] == ["RunFaulted", *TEARDOWN]
    assert node_starts(cluster) == ["start node 2", "start node 3"]
    assert node_stops(cluster) == ["stop node 2", "stop node 3"]
    assert final.recoveries_done == 0 and not final.replaced_nodes and all_stopped(final)
