"""Defect 13: ``mvp-gateway … 2>&1 | tee gw.log``, the pipe's reader gone, then Ctrl-C.

The gateway printed "shutting down run …" before it signalled the run; the print failed
once nothing read the pipe, so the signal was never sent: the run and its nodes ran on,
and the gateway took 40-76 s to exit. A broken stdout or stderr never stops a shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus

from mvp_core.models import RunOutcome, RunOutcomeKind
from temporal.client import RunHandle
from tests.integration.conftest import REPO, OrchestratorProcess, node_processes

RUN_ID = 4311
MODEL = "SmolLM2-135M-Instruct.Q4_1"
# The run's shutdown (two nodes stopped) takes a few seconds; before the fix the gateway
# needed 40-76 s to exit, and left the run running.
EXIT_S = 30.0


async def test_ctrl_c_with_a_dead_pipe_shuts_the_run_down_and_exits_promptly(
    client: Client,
    orchestrator: OrchestratorProcess,
    temporal_server: Any,
    state_dir: Path,
    tmp_path: Path,
):
    request = tmp_path / "run.json"
    request.write_text(json.dumps({"model": {"bundled": MODEL}, "pipeline_stages": 2}))
    env = {**os.environ, "TEMPORAL_ADDRESS": temporal_server.address}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.gateway.main",
            "--run-request",
            str(request),
            "--run-id",
            str(RUN_ID),
            "--listen",
            "127.0.0.1:0",
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # 2>&1 | tee: both streams into one pipe
    )
    run = RunHandle(client, RUN_ID)
    try:
        assert proc.stdout is not None
        lines: list[bytes] = []
        while not lines or b"is prompt-ready:" not in lines[-1]:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 180)
            assert line, b"".join(lines)
            lines.append(line)
        nodes = [n.handle.pid for n in (await run.snapshot()).nodes if n.handle and n.handle.pid]
        assert len(nodes) == 2
        proc.stdout.close()  # tee is gone: every later write to the pipe fails (EPIPE)
        began = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(proc.wait, EXIT_S + 30)
        took = time.monotonic() - began
        outcome = await asyncio.wait_for(run.result(), 30)
        assert outcome.outcome is RunOutcomeKind.OPERATOR_STOPPED, outcome
        assert isinstance(outcome, RunOutcome)
        assert code == 0, code
        assert took < EXIT_S, f"the gateway took {took:.1f} s to exit"
        assert not node_processes(state_dir), "the run's nodes outlived the gateway"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        with contextlib.suppress(Exception):
            if (await run.describe()).status is WorkflowExecutionStatus.RUNNING:
                await run.terminate("test clean-up")
        for node in node_processes(state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
