"""Issue 21, defect 1: a namespace without the project's search attributes made every
prompt's update wait forever (each workflow task failed with BadSearchAttributes, shown
only as a WARN in the worker's log). The orchestrator worker now refuses to start,
naming each missing attribute and the command that creates it."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from temporal.devserver import DevServer, start_dev_server, temporal_binary
from tests.helpers.waits import wait_until
from tests.integration.conftest import REPO, OrchestratorProcess


@pytest.fixture
def bare_server(tmp_path: Path) -> Iterator[DevServer]:
    """A dev server started as the earlier README said: MvpRunPhase only."""
    srv = start_dev_server(str(tmp_path / "t.db"), search_attributes={"MvpRunPhase": "Keyword"})
    yield srv
    srv.stop()


def run_worker(address: str, state: Path, timeout_s: float = 90.0) -> tuple[int, str, str]:
    """Start ``python -m workers.orchestrator``; its exit code, stdout and stderr once it
    exits (a worker that comes up instead is killed and reported with code -1)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.orchestrator"],
        env={**os.environ, "TEMPORAL_ADDRESS": address, "MVP_STATE_DIR": str(state)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=str(REPO),
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return -1, out.decode(), err.decode()
    return proc.returncode, out.decode(), err.decode()


def test_the_worker_refuses_a_namespace_without_the_prompt_status_attribute(
    bare_server: DevServer, tmp_path: Path
) -> None:
    code, out, err = run_worker(bare_server.address, tmp_path)
    assert code == 1, (code, out[-2000:], err[-2000:])
    assert "worker ready" not in out
    lines = [line for line in err.splitlines() if line.startswith("mvp-orchestrator worker:")]
    assert len(lines) == 1, err[-2000:]
    (line,) = lines
    command = (
        f"temporal operator search-attribute create --address {bare_server.address} "
        "--namespace default --name MvpPromptStatus --type Keyword"
    )
    assert "no search attribute MvpPromptStatus (Keyword)" in line
    assert command in line
    assert "MvpRunPhase" not in line  # the one it has is not named
    assert "Traceback" not in err

    # The command it names is the fix: run it, and the worker starts.
    argv = shlex.split(command)
    argv[0] = temporal_binary()
    subprocess.run(argv, check=True, capture_output=True, timeout=60)
    worker = OrchestratorProcess(bare_server.address, tmp_path, tmp_path, {})

    def started() -> bool:
        try:
            worker.start()
        except RuntimeError:  # the server may list a new attribute a moment after creating it
            return False
        return True

    wait_until(
        started,
        timeout=30,
        what="the worker to start",
        interval=0.5,
        detail=lambda: (tmp_path / f"orchestrator-{worker.starts}.log").read_text()[-2000:],
    )
    worker.stop()
