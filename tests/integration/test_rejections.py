"""Every rejection path is RunRejected, through the client and the `temporal` CLI
(hardening 2, 8): lifecycle RunAccepted -> RunPlanningStarted -> RunRejected for a
planning failure (only RunRejected for input that is refused before it is accepted),
nothing provisioned, no RunFaulted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from mvp_core import names
from mvp_core.models import LifecycleKind, RunPhase
from temporal.devserver import DevServer, temporal_binary
from tests.integration.conftest import Runs, node_processes, snapshot

pytestmark = pytest.mark.quick

MODEL = {"bundled": "SmolLM2-135M-Instruct.Q4_1"}
PLANNED = [
    LifecycleKind.RUN_ACCEPTED,
    LifecycleKind.RUN_PLANNING_STARTED,
    LifecycleKind.RUN_REJECTED,
]
REFUSED = [LifecycleKind.RUN_REJECTED]

CASES = [
    # (run id, request, words in the reason, lifecycle)
    (951, {"model": MODEL, "pipeline_stages": 31}, "exceeds GGUF layer count 30", PLANNED),
    (952, {"model": {"path": "/nonexistent/model.gguf"}}, "planning failed", PLANNED),
    (953, {"model": MODEL, "pipeline_stages": 0}, "must be greater than 0", REFUSED),
    (954, {"model": MODEL, "node_env": {"MVP_FAULT_MUTE": "1"}}, "test-only fault", REFUSED),
    (955, {"model": MODEL, "run_id": 4}, "does not match workflow id", REFUSED),
    (956, {"model": MODEL, "timeouts": {"ack_s": "soon"}}, "timeouts.ack_s", REFUSED),
    (957, {}, "missing model source", REFUSED),
]


async def _check_rejected(runs: Runs, run_id: int, words: str, lifecycle: list[LifecycleKind]):
    handle = runs.client.get_workflow_handle(names.run_workflow_id(run_id))
    with pytest.raises(WorkflowFailureError) as err:
        await handle.result()
    cause = err.value.cause
    assert isinstance(cause, ApplicationError), cause
    assert cause.type == "RunRejected", (cause.type, cause.message)
    assert words in cause.message, cause.message
    state = await snapshot(handle)
    assert state.phase == RunPhase.REJECTED
    assert [r.kind for r in state.lifecycle] == lifecycle
    assert all(n.handle is None for n in state.nodes)  # nothing provisioned
    return cause.message


@pytest.mark.parametrize(("run_id", "request_", "words", "lifecycle"), CASES)
async def test_every_rejection_is_run_rejected_through_the_client(
    runs: Runs, run_id: int, request_: dict, words: str, lifecycle: list[LifecycleKind]
):
    handle = await runs.client.start_workflow(
        names.RUN_WORKFLOW,
        request_,
        id=names.run_workflow_id(run_id),
        task_queue=names.ORCHESTRATOR_TASK_QUEUE,
    )
    runs.handles.append(handle)
    await _check_rejected(runs, run_id, words, lifecycle)


async def test_every_rejection_is_run_rejected_through_the_cli(
    temporal_server: DevServer, runs: Runs, state_dir: Path
):
    for run_id, request_, words, lifecycle in CASES:
        cli_id = run_id + 100
        if "run_id" in request_:
            request_ = {**request_, "run_id": 4}
        done = subprocess.run(
            [
                temporal_binary(), "workflow", "start", "--type", names.RUN_WORKFLOW,
                "--task-queue", names.ORCHESTRATOR_TASK_QUEUE,
                "--workflow-id", names.run_workflow_id(cli_id),
                "--input", json.dumps(request_), "--address", temporal_server.address,
            ],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        runs.handles.append(runs.client.get_workflow_handle(names.run_workflow_id(cli_id)))
        await _check_rejected(runs, cli_id, words, lifecycle)
        shown = subprocess.run(
            [
                temporal_binary(), "workflow", "show", "--workflow-id",
                names.run_workflow_id(cli_id), "-o", "json",
                "--address", temporal_server.address,
            ],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        events = json.loads(shown.stdout)["events"]
        failed = events[-1]["workflowExecutionFailedEventAttributes"]["failure"]
        assert failed["applicationFailureInfo"]["type"] == "RunRejected"
        assert failed["applicationFailureInfo"].get("nonRetryable") is True
        assert not any("activityTaskScheduledEventAttributes" in e and
                       e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
                       == names.ACT_START_NODE for e in events)  # fmt: skip
    assert node_processes(state_dir) == []
