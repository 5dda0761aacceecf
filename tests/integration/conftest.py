"""Integration fixtures: a real Temporal dev server, a real orchestrator worker process,
real node agent processes on the bundled SmolLM2 model."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.service import RPCError

from mvp_core import names
from mvp_core.edge_auth import EDGE_SECRET_ENV
from mvp_core.models import RunPhase, RunRequest
from mvp_core.run_state import RunState
from temporal.connect import connect
from temporal.devserver import DevServer, start_dev_server
from tests.helpers.dockerd import Dockerd, start_dockerd
from tests.helpers.hub_standin import HubStandin
from tests.helpers.runs import log_sizes, start_run, task_failures
from tests.helpers.waits import eventually, wait_until
from workers.host.embedded import worker_said_ready

REPO = Path(__file__).resolve().parents[2]
SECRET = "hf_mvpTestSecret_4b1d9e0c7a"
# The orchestrator worker's edge secret: tests derive each run's edge token from it and
# check that the token never shows up in Temporal or in logs.
EDGE_SECRET = base64.b64encode(b"mvp-test-edge-secret-0123456789ab").decode()
# The tests' own clients share the orchestrator's deployment secret, as a host and a
# gateway beside it do: their RunHandles read prompts' text from the head node (DECISIONS
# 63). A test of the Temporal-only path says so (RunHandle(..., direct_text=False)).
os.environ[EDGE_SECRET_ENV] = EDGE_SECRET


def node_processes(state_dir: Path) -> list[psutil.Process]:
    """Node agents started for this test session (their cwd lies under our state dir)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd", "status"]):
        try:
            cmd = proc.info["cmdline"] or []
            if "workers.node" in cmd and str(proc.info["cwd"] or "").startswith(str(state_dir)):
                if proc.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class OrchestratorProcess:
    """``python -m workers.orchestrator`` as a real process that tests can kill -9."""

    def __init__(
        self, address: str, state_dir: Path, log_dir: Path, extra_env: dict[str, str]
    ) -> None:
        self.address = address
        self.state_dir = state_dir
        self.log_dir = log_dir
        self.extra_env = extra_env
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = self.log_dir / f"orchestrator-{self.starts}.log"
        env = {
            **os.environ,
            "TEMPORAL_ADDRESS": self.address,
            "MVP_STATE_DIR": str(self.state_dir),
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers.orchestrator"],
            env=env,
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            cwd=str(REPO),
        )
        proc = self.proc

        def ready() -> bool:
            if worker_said_ready(log):
                return True
            if proc.poll() is not None:
                raise RuntimeError(f"orchestrator worker exited: {log.read_text()[-2000:]}")
            return False

        wait_until(
            ready,
            timeout=60,
            what="the orchestrator worker to start",
            interval=0.1,
            detail=lambda: log.read_text()[-2000:],
        )

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@contextlib.contextmanager
def orchestrator_with_hub(
    orchestrator: OrchestratorProcess, models_dir: Path, token: str | None
) -> Iterator[HubStandin]:
    """A hub stand-in (requiring ``token`` where given), and the session's orchestrator
    worker restarted with ``HF_ENDPOINT`` at it and a model cache of its own
    (``models_dir``); the worker is put back as it was after."""
    with HubStandin() as standin:
        standin.require_token = token
        saved = dict(orchestrator.extra_env)
        orchestrator.stop()
        orchestrator.extra_env = {
            **saved,
            "HF_ENDPOINT": standin.url,
            "MVP_MODELS_DIR": str(models_dir),
            "HF_HOME": str(models_dir.with_name(models_dir.name + "-hf-home")),
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        orchestrator.start()
        try:
            yield standin
        finally:
            orchestrator.stop()
            orchestrator.extra_env = saved
            orchestrator.start()


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mvp")


@pytest.fixture(scope="session")
def state_dir(session_dir: Path) -> Path:
    d = session_dir / "state"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def temporal_server(session_dir: Path) -> Iterator[DevServer]:
    # On all addresses: Docker nodes reach it through their run network's gateway.
    srv = start_dev_server(
        str(session_dir / "temporal.db"), log_file=str(session_dir / "temporal.log"), ip="0.0.0.0"
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def faults_file(session_dir: Path) -> Path:
    """Test-only fault knobs per run id, read by the orchestrator's process provider
    (a run request cannot switch fault injection on)."""
    path = session_dir / "faults.json"
    path.write_text("{}")
    return path


def docker_root(session_dir: Path) -> Path:
    """Where the tests' private Docker daemon lives (it starts only for Docker tests)."""
    return session_dir / "docker"


def harness_env(faults_file: Path) -> dict[str, str]:
    """What the test harness (never a run request) gives an orchestrator worker. Its
    Docker provider talks to the tests' private daemon, once a Docker test starts it."""
    return {
        "DOCKER_HOST": f"unix://{docker_root(faults_file.parent) / 'docker.sock'}",
        "HF_TOKEN": SECRET,
        "MVP_EDGE_SECRET": EDGE_SECRET,
        "MVP_TEST_FAULTS_FILE": str(faults_file),
        # The reaper's schedule is made, but sweeps only when a test triggers it (an
        # interval fires on multiples of it since the epoch: a day's is 00:00 UTC).
        "MVP_REAPER_INTERVAL_S": "86400",
    }


@pytest.fixture(scope="session")
def orchestrator(
    temporal_server: DevServer, state_dir: Path, session_dir: Path, faults_file: Path
) -> Iterator[OrchestratorProcess]:
    proc = OrchestratorProcess(
        temporal_server.address, state_dir, session_dir, harness_env(faults_file)
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def dockerd(session_dir: Path) -> Iterator[Dockerd]:
    daemon = start_dockerd(docker_root(session_dir))
    yield daemon
    daemon.stop()


@pytest.fixture(scope="session")
async def client(temporal_server: DevServer) -> Client:
    return await connect(temporal_server.address)


class Runs:
    """Starts runs and remembers them, so that every test can be checked for leaks."""

    def __init__(
        self, client: Client, orchestrator: OrchestratorProcess, faults_file: Path
    ) -> None:
        self.client = client
        self.orchestrator = orchestrator
        self.faults_file = faults_file
        self.handles: list[WorkflowHandle[object, object]] = []

    def set_faults(self, run_id: int, faults: dict[str, str]) -> None:
        table = json.loads(self.faults_file.read_text())
        table[str(run_id)] = faults
        tmp = self.faults_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(table))
        os.replace(tmp, self.faults_file)

    async def start(
        self, run_id: int, *, faults: dict[str, str] | None = None, **request: object
    ) -> WorkflowHandle[object, object]:
        """Start run ``run_id``; ``faults``: test-only MVP_FAULT_* knobs for its nodes."""
        self.set_faults(run_id, faults or {})
        req = RunRequest.model_validate(
            {
                "model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"},
                "default_max_tokens": 64,
                **request,
            }
        )
        handle = await start_run(self.client, run_id, req)
        self.handles.append(handle)
        return handle


@pytest.fixture
async def runs(
    client: Client, orchestrator: OrchestratorProcess, state_dir: Path, faults_file: Path
) -> AsyncIterator[Runs]:
    r = Runs(client, orchestrator, faults_file)
    seen = log_sizes(orchestrator.log_dir)
    yield r
    # No workflow task of the test's runs may have failed (see task_failures).
    failed_tasks = task_failures(orchestrator.log_dir, since=seen)
    # Leak check first: every run this test started must be closed with its nodes gone.
    if orchestrator.proc is None or orchestrator.proc.poll() is not None:
        orchestrator.start()
    still_open = []
    for h in r.handles:
        try:
            desc = await h.describe()
        except RPCError:
            continue
        if desc.status == WorkflowExecutionStatus.RUNNING:
            still_open.append(h.id)
    leaked = node_processes(state_dir)
    # Clean-up after the checks, so a failing test never leaves anything behind.
    for h in r.handles:
        try:
            await h.terminate("test clean-up")
        except RPCError:
            pass
    for p in node_processes(state_dir):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not still_open, f"runs left open by the test: {still_open}"
    assert not failed_tasks, f"workflow tasks failed: {failed_tasks[:3]}"
    assert not leaked, f"node processes survived the test: {[p.pid for p in leaked]}"


async def snapshot(handle: WorkflowHandle[object, object]) -> RunState:
    state: RunState = await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)
    return state


async def wait_phase(
    handle: WorkflowHandle[object, object], phase: RunPhase, timeout: float = 90.0
) -> RunState:
    """The run's state once it is in ``phase``; a run stopping first fails at once."""
    last: RunState | None = None

    async def reached() -> RunState | None:
        nonlocal last
        try:
            last = await snapshot(handle)
        except RPCError:
            last = None
            return None
        if last.phase == phase:
            return last
        if last.stopping and phase not in (RunPhase.TEARING_DOWN, RunPhase.TORN_DOWN):
            raise AssertionError(f"run is stopping: {last.first_fault}")
        return None

    return await eventually(
        reached,
        timeout=timeout,
        what=f"phase {phase}",
        interval=0.2,
        detail=lambda: f"last phase: {last and last.phase}",
    )


async def activity_started(handle: WorkflowHandle[Any, Any], activity: str) -> bool:
    """Whether the run has ``activity`` started (a worker holds it, heartbeating)."""
    desc = await handle.describe()
    return any(
        pa.activity_type.name == activity
        and pa.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
        for pa in desc.raw_description.pending_activities
    )


async def wait_state(
    handle: WorkflowHandle[object, object],
    holds: Callable[[RunState], object],
    what: str,
    timeout: float = 60.0,
) -> RunState:
    """The run's state once ``holds(state)`` (a prompt generating, one queued, a phase):
    what a test waits for before it acts on the run, however loaded the machine."""

    async def check() -> RunState | None:
        state = await snapshot(handle)
        return state if holds(state) else None

    return await eventually(check, timeout=timeout, what=what)


async def wait_closed(
    handle: WorkflowHandle[object, object], timeout: float = 60.0
) -> WorkflowExecutionStatus:
    """The run's status once it is no longer running."""

    async def closed() -> WorkflowExecutionStatus | None:
        status = (await handle.describe()).status
        return status if status != WorkflowExecutionStatus.RUNNING else None

    return await eventually(closed, timeout=timeout, what=f"{handle.id} to close", interval=0.2)


async def run_failure(handle: WorkflowHandle[object, object]) -> str:
    """The failure message of a run that must fail (RunFaulted / RunRejected)."""
    try:
        await handle.result()
    except WorkflowFailureError as err:
        return str(getattr(err.cause, "message", err.cause))
    raise AssertionError("run did not fail")


def node_pids(state: RunState) -> list[int]:
    return sorted(
        n.handle.pid for n in state.nodes if n.handle is not None and n.handle.pid is not None
    )


SHUTDOWN = timedelta(seconds=0)
