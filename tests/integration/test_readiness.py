"""Must-hold 2: readiness is the spec's barrier and nothing else."""

from __future__ import annotations

from mvp_core import names
from mvp_core.models import NodeRuntimeReady, RunPhase
from tests.integration.conftest import Runs, run_failure, snapshot, wait_closed, wait_state

FAST = {"timeouts": {"readiness_s": 12}}


async def test_forged_and_stale_reports_do_not_advance_and_log_lines_and_ports_never_make_ready(
    runs: Runs,
):
    # The node looks ready in its log and listens on a port, but never reports.
    handle = await runs.start(301, faults={"MVP_FAULT_MUTE": "1"}, **FAST)
    state = await wait_state(handle, lambda s: s.phase == RunPhase.READINESS, "readiness")
    node = state.nodes[0]
    good = dict(
        run_id=301,
        node_id=node.node_id,
        stage_index=0,
        endpoint="x",
        node_actor=node.task_queue,
        worker_identity=f"{node.task_queue}@forged",
        readiness_id=node.readiness_id,
    )
    forged = [
        {**good, "run_id": 999},
        {**good, "node_id": 42},
        {**good, "readiness_id": "0badc0de-1-0"},
        # a node of an earlier execution with the same run_id: other nonce in queue and readiness id
        {**good, "node_actor": "mvp-node-301-1-00000000", "readiness_id": "00000000-1-0"},
    ]
    for report in forged:
        await handle.signal(names.SIGNAL_NODE_RUNTIME_READY, NodeRuntimeReady(**report))
    state = await wait_state(
        handle, lambda s: s.ignored_reports >= len(forged), "the forged reports ignored"
    )
    assert state.nodes[0].runtime_ready is None
    assert state.phase == RunPhase.READINESS
    cause = await run_failure(handle)
    assert "NodeRuntimeReady" in cause and "startup (readiness)" in cause
    await wait_closed(handle)


async def test_no_prompt_ready_when_poller_identity_does_not_match(runs: Runs):
    handle = await runs.start(
        302, faults={"MVP_FAULT_REPORT_IDENTITY": "someone-else@host:1"}, **FAST
    )
    cause = await run_failure(handle)
    # a real mismatch verdict naming the poller seen, not the check's retries running out
    assert "route owner" in cause and "expected poller 'someone-else@host:1'" in cause, cause
    assert "saw ['mvp-node-302-1-" in cause, cause
    # The route check's own verdict, not the readiness deadline (which would say what did
    # not happen, or time the check out). No wall-clock bound: on a loaded machine the
    # start and the teardown around it take their time (a CI run took 13 s against 12).
    assert "did not" not in cause and "timed out" not in cause.lower(), cause
    state = await snapshot(handle)
    assert not any(r.kind.value == "RunReady" for r in state.lifecycle)
    assert state.torn_down


async def test_no_prompt_ready_before_lease_started(runs: Runs):
    handle = await runs.start(303, faults={"MVP_FAULT_NO_LEASE_REPORT": "1"}, **FAST)
    cause = await run_failure(handle)
    assert "lease never started" in cause, cause
    state = await snapshot(handle)
    assert state.nodes[0].runtime_ready is not None  # it did report
    assert not any(r.kind.value == "RunReady" for r in state.lifecycle)
