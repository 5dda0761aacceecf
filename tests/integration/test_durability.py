"""Must-hold 5 and 8: a killed orchestrator worker loses nothing; secrets stay out."""

from __future__ import annotations

import asyncio
import json

import psutil
from google.protobuf.json_format import MessageToJson

from mvp_core import names
from mvp_core.models import Done, RequestShutdown, RunOutcome, RunPhase, SubmitPrompt
from temporal.client import RunHandle
from tests.integration.conftest import (
    SECRET,
    OrchestratorProcess,
    Runs,
    node_pids,
    snapshot,
    wait_phase,
    wait_state,
)


async def test_kill9_worker_while_ready_and_while_generating(
    runs: Runs, orchestrator: OrchestratorProcess
):
    handle = await runs.start(601)
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    pids = node_pids(state)

    orchestrator.kill9()  # while prompt-ready
    await asyncio.sleep(1.0)
    orchestrator.start()
    r1 = await RunHandle(runs.client, 601).submit(
        SubmitPrompt(request_id=1, prompt_text="Hello", max_tokens=8)
    )
    assert isinstance(r1, Done)

    prompt = asyncio.ensure_future(
        RunHandle(runs.client, 601).submit(
            SubmitPrompt(request_id=2, prompt_text="Once upon a time", max_tokens=96),
        )
    )
    await wait_state(
        handle, lambda s: 2 in {p.request_id for p in s.actives()}, "prompt 2 generating"
    )
    orchestrator.kill9()  # while a prompt is generating
    await asyncio.sleep(0.5)
    orchestrator.start()
    r2 = await prompt
    assert isinstance(r2, Done) and r2.tokens_generated == 96

    state = await snapshot(handle)
    assert node_pids(state) == pids  # no node started twice
    assert all(psutil.pid_exists(p) for p in pids)
    assert len(list((orchestrator.state_dir / "nodes").glob("mvp-601-*"))) == 1
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=601))
    outcome = RunOutcome.model_validate(await handle.result())
    assert outcome.lifecycle[-1].kind.value == "RunTornDown"


async def test_secret_in_worker_env_stays_out_of_nodes_and_history(runs: Runs):
    handle = await runs.start(602)
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    node = psutil.Process(node_pids(state)[0])
    # The worker holds HF_TOKEN (the harness gives it one); no node downloads from the hub.
    assert "HF_TOKEN" not in node.environ() and SECRET not in node.environ().values()
    r = await RunHandle(runs.client, 602).submit(
        SubmitPrompt(request_id=1, prompt_text="Hi", max_tokens=4)
    )
    assert isinstance(r, Done)
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=602))
    RunOutcome.model_validate(await handle.result())
    history = await handle.fetch_history()
    assert SECRET not in history.to_json()
    desc = await handle.describe()
    assert SECRET not in MessageToJson(desc.raw_description)
    assert SECRET not in json.dumps((await snapshot(handle)).model_dump(mode="json"))
    async for wf in runs.client.list_workflows("WorkflowId STARTS_WITH 'mvp-run-602'"):
        child_history = await runs.client.get_workflow_handle(
            wf.id, run_id=wf.run_id
        ).fetch_history()
        assert SECRET not in child_history.to_json()
