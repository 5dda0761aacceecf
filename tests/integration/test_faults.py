"""Must-hold 4: faults fail the run with the phase named and tear everything down."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from mvp_core import names
from mvp_core.models import RequestShutdown, RunOutcome, RunPhase, SubmitPrompt
from mvp_core.run_state import RunState
from temporal.client import RunHandle
from tests.helpers.waits import eventually
from tests.integration.conftest import (
    Runs,
    activity_started,
    node_pids,
    node_processes,
    run_failure,
    snapshot,
    wait_phase,
    wait_state,
)


async def test_node_exit_before_ready_fails_startup_fast_and_tears_down(runs: Runs):
    t0 = time.monotonic()
    handle = await runs.start(501, faults={"MVP_FAULT_EXIT_BEFORE_READY": "1"})
    cause = await run_failure(handle)
    assert time.monotonic() - t0 < 30
    assert cause.startswith("startup ("), cause
    assert "node 1 exited" in cause
    state = await snapshot(handle)
    assert state.torn_down and state.nodes[0].provider_stopped


async def test_node_killed_during_generation_faults_prompt_and_run_within_15s(runs: Runs):
    # each piece of text held 10 ms: the prompt cannot reach EOS before the kill, however
    # fast the machine
    handle = await runs.start(502, faults={"MVP_FAULT_TEXT_DELAY_MS": "10"})
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    pid = node_pids(state)[0]
    prompt = asyncio.ensure_future(
        RunHandle(runs.client, 502).submit(
            SubmitPrompt(request_id=1, prompt_text="Once upon a time", max_tokens=2000),
        )
    )
    await wait_state(
        handle, lambda s: 1 in {p.request_id for p in s.actives()}, "prompt 1 generating"
    )
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    result = await prompt
    assert result.type == "fault", result
    cause = await run_failure(handle)
    assert time.monotonic() - t0 < 15, time.monotonic() - t0
    assert cause.startswith("prompt serving"), cause
    state = await snapshot(handle)
    assert state.torn_down
    assert [r.kind.value for r in state.lifecycle].count("RunFaulted") == 1  # first fault is sticky


async def test_a_stop_that_really_fails_is_kept_and_every_stop_is_attempted(runs: Runs):
    handle = await runs.start(503, timeouts={"stage_stopped_wait_s": 3, "stop_grace_s": 1})
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    pid = node_pids(state)[0]
    os.kill(pid, signal.SIGSTOP)  # frozen: StopRun cannot be served, SIGTERM is not acted on
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=503))
    outcome = RunOutcome.model_validate(await handle.result())
    assert outcome.outcome.value == "operator_stopped", outcome
    assert outcome.first_stop_error is not None and "StopRun stage 0" in outcome.first_stop_error
    assert outcome.first_fault is None
    state = await snapshot(handle)
    assert state.nodes[0].provider_stopped  # the provider stop was still attempted and killed it
    assert [r.kind.value for r in outcome.lifecycle][-1] == "RunTornDown"


async def test_an_operator_stop_whose_provider_stop_fails_fails_the_run_naming_it(runs: Runs):
    handle = await runs.start(504, faults={"MVP_FAULT_PROVIDER_STOP": "1"})
    await wait_phase(handle, RunPhase.PROMPT_READY)
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
    with pytest.raises(WorkflowFailureError) as err:
        await handle.result()
    cause = err.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "RunStopFailed"
    assert "provider stop node 1: injected provider stop failure" in cause.message
    outcome = RunOutcome.model_validate(cause.details[0])
    assert outcome.outcome.value == "operator_stopped" and outcome.first_fault is None
    assert outcome.lifecycle[-1].kind.value == "RunTornDown"


async def test_a_node_dying_after_an_operator_stop_does_not_make_the_run_faulted(runs: Runs):
    handle = await runs.start(
        505,
        pipeline_stages=2,
        faults={"MVP_FAULT_TEXT_DELAY_MS": "10"},
        timeouts={"stop_grace_s": 1},
    )
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    prompt = asyncio.ensure_future(
        RunHandle(runs.client, 505).submit(
            SubmitPrompt(request_id=1, prompt_text="Once upon", max_tokens=2000)
        )
    )
    # The stop comes once the prompt is admitted and generating, however long that takes
    # on a loaded machine (a shutdown first would reject it: RunShuttingDown).

    def active(s: RunState) -> bool:
        assert not prompt.done(), prompt.result()
        return s.active is not None

    await wait_state(handle, active, "the prompt to become active")
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
    os.kill(node_pids(state)[-1], signal.SIGKILL)  # a fault after the stop: a fact only
    result = await prompt
    assert result.type == "fault"
    outcome = RunOutcome.model_validate(await handle.result())
    assert outcome.outcome.value == "operator_stopped", outcome
    assert outcome.first_fault is None
    kinds = [r.kind.value for r in outcome.lifecycle]
    assert "RunFaulted" not in kinds and kinds[-1] == "RunTornDown"


async def test_shutdown_during_a_slow_planning_takes_effect_at_once(runs: Runs):
    """Every wait watches for shutdown: planning (which heartbeats) is abandoned, and
    the run ends as an operator stop with nothing provisioned."""
    handle = await runs.start(506, faults={"MVP_FAULT_PLAN_DELAY_S": "120"})
    await wait_phase(handle, RunPhase.PLANNING, timeout=30)
    await eventually(
        lambda: activity_started(handle, names.ACT_PREPARE_PLAN),
        timeout=30,
        what="the planning activity to start",
    )
    t0 = time.monotonic()
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
    outcome = RunOutcome.model_validate(await handle.result())
    # At once, not when the 120 s planning ends (the bound is loose for a loaded machine).
    assert time.monotonic() - t0 < 30, time.monotonic() - t0
    assert outcome.outcome.value == "operator_stopped"
    kinds = [r.kind.value for r in outcome.lifecycle]
    assert "RunProvisioningStarted" not in kinds and kinds[-1] == "RunTornDown"


async def test_a_run_cancelled_while_nodes_start_leaves_no_node(runs: Runs, state_dir):
    """`temporal workflow cancel` in provisioning: a start in flight is finished, not
    abandoned, so teardown knows and stops every node it launched. Each start stays in
    flight 5 s after its node launched (test-only MVP_FAULT_START_DELAY_S), so the cancel
    lands in provisioning however slowly the snapshot is polled."""
    handle = await runs.start(507, pipeline_stages=3, faults={"MVP_FAULT_START_DELAY_S": "5"})
    await wait_state(handle, lambda s: s.phase == RunPhase.PROVISIONING, "provisioning")
    await handle.cancel()
    outcome = RunOutcome.model_validate(await handle.result())
    assert outcome.outcome.value == "operator_stopped"
    state = await snapshot(handle)
    assert all(n.provider_stopped for n in state.nodes if n.start_attempted)
    assert node_processes(state_dir) == []  # at once, not by the nodes' dead-man switch
