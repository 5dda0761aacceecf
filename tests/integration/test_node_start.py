"""A node is never started twice (hardening 12): a worker killed between launching a
node process and recording it leaves a node that the retried start adopts."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import psutil

from mvp_core import names
from mvp_core.models import RunOutcome, RunPhase, RunRequest
from temporal.connect import connect
from temporal.devserver import start_dev_server
from tests.helpers.waits import eventually
from tests.integration.conftest import (
    OrchestratorProcess,
    harness_env,
    node_processes,
    snapshot,
    wait_phase,
)


def _marked(state_dir: Path) -> dict[str, list[int]]:
    """Live node processes by their --resource= mark."""
    found: dict[str, list[int]] = {}
    for proc in node_processes(state_dir):
        mark = next((a for a in proc.cmdline() if a.startswith("--resource=")), "?")
        found.setdefault(mark, []).append(proc.pid)
    return found


async def test_a_start_retried_after_the_worker_died_mid_launch_adopts_the_node(tmp_path: Path):
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({}))
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    server = start_dev_server(str(tmp_path / "t.db"), log_file=str(tmp_path / "temporal.log"))
    crashing = OrchestratorProcess(
        server.address,
        state_dir,
        tmp_path,
        {**harness_env(faults), "MVP_TEST_CRASH_AFTER_LAUNCH": "1"},
    )
    healthy = OrchestratorProcess(server.address, state_dir, tmp_path, harness_env(faults))
    try:
        crashing.start()
        client = await connect(server.address)
        handle = await client.start_workflow(
            names.RUN_WORKFLOW,
            RunRequest.model_validate(
                {"model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"}, "default_max_tokens": 8}
            ),
            id=names.run_workflow_id(971),
            task_queue=names.ORCHESTRATOR_TASK_QUEUE,
            task_timeout=timedelta(seconds=names.WORKFLOW_TASK_TIMEOUT_S),
        )
        assert crashing.proc is not None
        crashing.proc.wait(60)  # it launched node 1, then died before recording it
        launched = _marked(state_dir)
        assert len(launched) == 1 and all(len(p) == 1 for p in launched.values()), launched
        healthy.start()
        state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=90)
        assert _marked(state_dir) == launched  # adopted, not launched again
        assert state.nodes[0].handle is not None
        assert [state.nodes[0].handle.pid] == next(iter(launched.values()))
        assert state.nodes[0].route_owned
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
        outcome = RunOutcome.model_validate(await handle.result())
        assert outcome.outcome.value == "operator_stopped"
        await eventually(
            lambda: node_processes(state_dir) == [],
            timeout=10,
            what="no node process left",
            interval=0.2,
            detail=lambda: repr(node_processes(state_dir)),
        )
        assert (await snapshot(handle)).torn_down
    finally:
        crashing.stop()
        healthy.stop()
        for proc in node_processes(state_dir):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        server.stop()
