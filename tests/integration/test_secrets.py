"""The data-plane edge token never passes through Temporal (hardening 7)."""

from __future__ import annotations

import base64
import json

import psutil

from activities.providers.base import edge_token
from mvp_core import names
from mvp_core.models import Done, RunPhase, SubmitPrompt
from temporal.client import RunHandle
from tests.helpers.secret_scan import scan
from tests.integration.conftest import (
    EDGE_SECRET,
    SECRET,
    OrchestratorProcess,
    Runs,
    node_pids,
    snapshot,
    wait_phase,
)


async def test_edge_token_reaches_nodes_but_never_history_queries_or_logs(
    runs: Runs, orchestrator: OrchestratorProcess
):
    handle = await runs.start(961, pipeline_stages=2)
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    assert len(state.nonce) == 8  # the query shows only the part in queue names
    history = (await handle.fetch_history()).to_json()
    nonce = next(
        json.loads(base64.b64decode(p["data"]))["nonce"]
        for e in json.loads(history)["events"]
        if e.get("activityTaskScheduledEventAttributes", {}).get("activityType", {}).get("name")
        == names.ACT_START_NODE
        for p in e["activityTaskScheduledEventAttributes"]["input"]["payloads"]
    )
    token = edge_token(base64.b64decode(EDGE_SECRET), handle.id, nonce)
    envs = [psutil.Process(pid).environ() for pid in node_pids(state)]
    assert {e.get("MVP_EDGE_TOKEN") for e in envs} == {token}  # both stages derive the same
    r = await RunHandle(runs.client, 961).submit(
        SubmitPrompt(request_id=1, prompt_text="Hello", max_tokens=4)
    )
    assert isinstance(r, Done)  # the edges authenticated with it
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
    await handle.result()
    logs = [*orchestrator.log_dir.glob("orchestrator-*.log")]
    logs += [n for n in (orchestrator.state_dir / "nodes").glob("mvp-961-*/node.*")]
    logs += [*(orchestrator.state_dir / "runs").glob("961/frames.jsonl")]
    report = await scan(
        runs.client,
        secrets=[SECRET],
        edge_secret=base64.b64decode(EDGE_SECRET),
        logs=logs,
        query="WorkflowId STARTS_WITH 'mvp-run-961'",
    )
    assert token in report.edge_tokens and report.log_files >= 3 and report.queries == 1
    assert report.findings == []
    assert (await snapshot(handle)).nonce == state.nonce
