"""Must-hold 6: long runs continue-as-new with their nodes and lose no prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from mvp_core import names
from mvp_core.models import Done, RequestShutdown, RunOutcome, RunPhase, RunRequest, SubmitPrompt
from temporal.client import PromptRejected, RunHandle
from temporal.connect import connect
from temporal.devserver import start_dev_server
from tests.helpers.fake_cluster import wait_completed
from tests.integration.conftest import (
    OrchestratorProcess,
    Runs,
    harness_env,
    node_pids,
    node_processes,
    wait_phase,
)


@pytest.fixture
async def low_threshold(tmp_path: Path):
    srv = start_dev_server(
        str(tmp_path / "t.db"), dynamic_config={"limit.historyCount.suggestContinueAsNew": "150"}
    )
    state = tmp_path / "state"
    state.mkdir()
    faults = tmp_path / "faults.json"
    faults.write_text("{}")
    worker = OrchestratorProcess(srv.address, state, tmp_path, harness_env(faults))
    worker.start()
    client = await connect(srv.address)
    runs = Runs(client, worker, faults)
    yield runs, state
    for h in runs.handles:
        try:
            await h.terminate("clean-up")
        except Exception:
            pass
    leaked = node_processes(state)
    for proc in node_processes(state):
        proc.kill()
    worker.stop()
    srv.stop()
    assert not leaked


async def _submit(client: Client, request_id: int) -> Done:
    while True:
        try:
            r = await RunHandle(client, 701).submit(
                SubmitPrompt(request_id=request_id, prompt_text="Hi", max_tokens=2)
            )
        except PromptRejected as err:
            assert err.kind == "RunRollingOver", err
            continue
        assert isinstance(r, Done), r
        return r


async def test_thirty_prompts_cross_two_continue_as_new_on_the_same_nodes(low_threshold):
    runs, _ = low_threshold
    handle = await runs.start(701)
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    pids = node_pids(state)
    for i in range(30):
        await _submit(runs.client, i)
    state = await wait_completed(runs.client.get_workflow_handle(names.run_workflow_id(701)), 30)
    assert state.continued >= 2, state.continued
    assert state.prompts_completed == 30 and state.prompts_faulted == 0
    assert node_pids(state) == pids
    completed = [r.request_id for r in state.lifecycle if r.kind.value == "PromptCompleted"]
    assert completed == list(range(30))  # exactly one terminal event each
    latest = runs.client.get_workflow_handle(names.run_workflow_id(701))
    await latest.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=701))
    outcome = RunOutcome.model_validate(await latest.result())
    assert outcome.lifecycle[-1].kind.value == "RunTornDown"
    assert RunRequest  # typed import kept for readers
