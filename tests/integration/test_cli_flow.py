"""Must-hold 1: the documented `temporal` CLI flow on a real run."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mvp_core.models import RunPhase
from temporal.devserver import DevServer, temporal_binary
from tests.integration.conftest import (
    REPO,
    Runs,
    node_processes,
    run_failure,
    snapshot,
    wait_closed,
    wait_phase,
)

pytestmark = pytest.mark.quick


def cli(server: DevServer, *args: str) -> str:
    done = subprocess.run(
        [temporal_binary(), *args, "--address", server.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def documented_update_output() -> dict[str, Any]:
    """The sample output of ``temporal workflow update execute ... -o json`` in
    docs/cli-flow.md (step 4)."""
    text = (REPO / "docs" / "cli-flow.md").read_text()
    found = re.search(r"```json\n(\s*\{\s*\"name\": \"submit_prompt\".*?)```", text, re.S)
    assert found is not None, "docs/cli-flow.md has no sample of the Update's output"
    sample: dict[str, Any] = json.loads(found.group(1))
    return sample


def start_run(server: DevServer, workflow_id: str, *input_args: str) -> None:
    cli(
        server,
        "workflow",
        "start",
        "--type",
        "RunWorkflow",
        "--task-queue",
        "mvp-orchestrator",
        "--workflow-id",
        workflow_id,
        *input_args,
    )


async def test_cli_start_prompt_query_shutdown(
    temporal_server: DevServer, runs: Runs, state_dir: Path
):
    wf = "mvp-run-7"
    start_run(temporal_server, wf, "--input-file", str(REPO / "docs/examples/run-direct.json"))
    handle = runs.client.get_workflow_handle(wf)
    runs.handles.append(handle)
    await wait_phase(handle, RunPhase.PROMPT_READY)

    out = cli(
        temporal_server,
        "workflow",
        "update",
        "execute",
        "--workflow-id",
        wf,
        "--name",
        "submit_prompt",
        "--input",
        '{"request_id":1,"prompt_text":"The capital of France is","max_tokens":16}',
        "-o",
        "json",
    )
    result = json.loads(out)
    done = result.get("result", result)
    assert done["type"] == "done", out
    assert done["final_text"].startswith(" Paris."), done
    assert 1 <= done["tokens_generated"] <= 16
    # docs/cli-flow.md shows this output: the same fields, none missing, none extra.
    sample = documented_update_output()
    assert sorted(sample) == sorted(result), out
    assert sorted(sample["result"]) == sorted(done), out

    snap = json.loads(
        cli(
            temporal_server,
            "workflow",
            "query",
            "--workflow-id",
            wf,
            "--name",
            "snapshot",
            "-o",
            "json",
        )
    )
    snap = snap.get("queryResult", snap)
    snap = snap[0] if isinstance(snap, list) else snap
    assert snap["phase"] == "prompt_ready"
    assert [n["node_id"] for n in snap["nodes"]] == [1]
    assert snap["prompts_completed"] == 1

    cli(
        temporal_server,
        "workflow",
        "signal",
        "--workflow-id",
        wf,
        "--name",
        "request_shutdown",
        "--input",
        '{"run_id":7,"reason":"operator_requested"}',
    )
    status = await wait_closed(handle)
    assert status.name == "COMPLETED"
    outcome = await handle.result()
    kinds = [r["kind"] for r in outcome["lifecycle"]] if isinstance(outcome, dict) else []
    assert kinds[-1] == "RunTornDown" and kinds.count("RunTornDown") == 1
    assert "RunOperatorStopped" in kinds
    assert node_processes(state_dir) == []


async def test_malformed_cli_input_rejects_the_run_naming_the_fields(
    temporal_server: DevServer, runs: Runs, state_dir: Path
):
    """A request the SDK cannot decode into a RunRequest is a RunRejected run, not a
    workflow task that fails forever."""
    bad = {
        "model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"},
        "stream_batch_ms": 5,
        "engine": {"token_path_nice": 50},
        "pipeline_stage": 2,
    }
    for wf, text in (("mvp-run-8", json.dumps(bad)), ("mvp-run-9", "[1, 2]")):
        start_run(temporal_server, wf, "--input", text)
        runs.handles.append(runs.client.get_workflow_handle(wf))
    first, second = runs.handles[-2:]
    cause = await run_failure(first)
    assert cause.startswith("invalid run request: "), cause
    assert "stream_batch_ms: Input should be greater than or equal to 25" in cause
    assert "engine.token_path_nice: Input should be less than or equal to 19" in cause
    assert "pipeline_stage: Extra inputs are not permitted" in cause
    assert await run_failure(second) == "invalid run request: expected a JSON object, got an array"
    assert (await snapshot(first)).phase == RunPhase.REJECTED
    assert node_processes(state_dir) == []
