"""A whole run on an orchestrator worker that caches no workflow (MVP_MAX_CACHED_WORKFLOWS=0).

Every workflow task of the run and of its prompts is then replayed from history before it
runs, so any non-determinism in the code paths of a real run (startup, streaming, cancel,
teardown) shows up as a failed workflow task instead of passing on the warm cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType, TaskQueueKind, WorkflowTaskFailedCause
from temporalio.client import Client

from mvp_core import names
from mvp_core.models import (
    CancelPrompt,
    Done,
    Fault,
    RequestShutdown,
    RunOutcome,
    RunPhase,
    SubmitPrompt,
    TextDelta,
)
from temporal.client import RunHandle
from temporal.connect import connect
from temporal.devserver import start_dev_server
from tests.helpers.runs import task_failures
from tests.helpers.waits import eventually
from tests.integration.conftest import (
    OrchestratorProcess,
    Runs,
    harness_env,
    node_processes,
    wait_phase,
    wait_state,
)

RUN = 1601
UNHANDLED_COMMAND = WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND


@pytest.fixture
async def uncached(tmp_path: Path) -> AsyncIterator[tuple[Runs, Path, Path]]:
    srv = start_dev_server(str(tmp_path / "t.db"), log_file=str(tmp_path / "temporal.log"))
    state = tmp_path / "state"
    state.mkdir()
    faults = tmp_path / "faults.json"
    faults.write_text("{}")
    worker = OrchestratorProcess(
        srv.address, state, tmp_path, {**harness_env(faults), "MVP_MAX_CACHED_WORKFLOWS": "0"}
    )
    runs: Runs | None = None
    try:
        worker.start()
        client: Client = await connect(srv.address)
        runs = Runs(client, worker, faults)
        yield runs, state, tmp_path
    finally:
        for h in runs.handles if runs else []:
            try:
                await h.terminate("clean-up")
            except Exception:
                pass
        for proc in node_processes(state):
            proc.kill()
        worker.stop()
        srv.stop()


@pytest.mark.parametrize("host", ["workflow", "run"])
async def test_a_two_stage_run_serves_streams_cancels_and_stops_replaying_every_task(
    uncached, host: str
):
    """Prompts in PromptWorkflows, and served by the run itself (DECISIONS 66)."""
    runs, state_dir, log_dir = uncached
    client = runs.client
    # Each piece of text held 20 ms: the long prompt is surely active when it is cancelled.
    # A 2048-token context: the long prompt cannot end on a full context before its
    # cancel arrives on a busy machine (with the default 512 it once did).
    handle = await runs.start(
        RUN,
        pipeline_stages=2,
        default_max_tokens=8,
        max_context=2048,
        prompt_host=host,
        faults={"MVP_FAULT_TEXT_DELAY_MS": "20"},
    )
    await wait_phase(handle, RunPhase.PROMPT_READY, timeout=120)

    events = [
        ev
        async for ev in RunHandle(client, RUN).stream(
            SubmitPrompt(request_id=1, prompt_text="Once upon a time", max_tokens=16)
        )
    ]
    done = events[-1]
    assert isinstance(done, Done) and done.tokens_generated == 16, done
    assert all(isinstance(e, TextDelta) for e in events[:-1]) and len(events) > 1
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == done.final_text

    long = await RunHandle(client, RUN).start_prompt(
        SubmitPrompt(request_id=2, prompt_text="Once upon", max_tokens=2000)
    )
    await wait_state(
        handle,
        lambda s: s.active is not None and s.active.request_id == 2,
        "prompt 2 active",
        timeout=30,
    )
    await handle.signal(names.SIGNAL_CANCEL_PROMPT, CancelPrompt(request_id=2))
    cancelled = await long.result()
    assert isinstance(cancelled, Fault) and "cancelled" in cancelled.error, cancelled

    third = await RunHandle(client, RUN).submit(SubmitPrompt(request_id=3, prompt_text="Hi"))
    assert isinstance(third, Done) and third.tokens_generated >= 1, third

    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=RUN))
    outcome = RunOutcome.model_validate(await handle.result())
    assert outcome.outcome.value == "operator_stopped", outcome
    assert outcome.first_fault is None and outcome.first_stop_error is None, outcome
    kinds = [r.kind.value for r in outcome.lifecycle]
    assert kinds.count("RunTornDown") == 1 and kinds[-1] == "RunTornDown", kinds
    assert outcome.prompts_completed == 2 and outcome.prompts_cancelled == 1, outcome
    assert outcome.prompts_faulted == 0, outcome
    await eventually(
        lambda: node_processes(state_dir) == [],
        timeout=10,
        what="no node process left",
        interval=0.2,
        detail=lambda: repr([p.pid for p in node_processes(state_dir)]),
    )
    # No workflow task failed on the way, and none went to a sticky queue: with no cache
    # the worker takes every task from the normal queue, with the whole history. The
    # server's UnhandledCommand is no failure of the code: the run's last task tried to
    # complete while an event (the provider watch's last activity) arrived, so the
    # server had the worker see that event first (slow uncached tasks make it likely).
    history = await handle.fetch_history()
    task_failed = [
        (e.event_id, e.workflow_task_failed_event_attributes)
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
        and e.workflow_task_failed_event_attributes.cause != UNHANDLED_COMMAND
    ]
    assert not task_failed, task_failed
    scheduled = [
        e.workflow_task_scheduled_event_attributes.task_queue.kind
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED
    ]
    assert len(scheduled) > 20 and TaskQueueKind.TASK_QUEUE_KIND_STICKY not in scheduled
    assert not task_failures(log_dir), task_failures(log_dir)[:3]
