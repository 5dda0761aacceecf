"""The embedded default of the host commands (the demo, ``mvp-orchestrator``): an
orchestrator worker process they own next to a local dev server, and how to stop both."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from mvp_core.errors import ErrorType
from mvp_core.models import ProviderKind
from temporal.connect import local_server_env

# Runs the orchestrator worker with PR_SET_PDEATHSIG armed, then execs it: a host killed
# hard (SIGKILL) takes its worker along instead of leaving it polling a dead server. An
# exec wrapper rather than preexec_fn, because the host's Temporal client runs threads.
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def dev_server_ip(provider: ProviderKind) -> str:
    """Where an embedded dev server listens: loopback, except for Docker nodes, which
    reach it through their run network's gateway (docs/docker.md)."""
    return "0.0.0.0" if provider is ProviderKind.DOCKER else "127.0.0.1"


def start_worker(
    address: str, state_dir: Path, log_path: Path, extra_env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``python -m workers.orchestrator`` on the local dev server at ``address``, dying
    with this process, its output in ``log_path``. Its own process group: a terminal's
    Ctrl-C reaches the host alone, which stops the run while the worker can still run
    the run's teardown. It connects in plaintext to namespace default, whatever Temporal
    settings (TLS, API key, profile) this process's environment holds."""
    env = {
        **local_server_env(address),
        "PYTHONUNBUFFERED": "1",
        # Node directories, the cwd of node processes, live in the host's state directory.
        "MVP_STATE_DIR": str(state_dir),
        **(extra_env or {}),
    }
    cmd = [sys.executable, "-m", "workers.orchestrator"]
    if sys.platform.startswith("linux"):
        cmd = [sys.executable, "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *cmd]
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
        )


def stop_process(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM, ``grace_s`` to exit, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def failure_text(err: WorkflowFailureError) -> str:
    """A failed run's reason in one line."""
    cause = err.cause
    if isinstance(cause, ApplicationError) and cause.type in (
        ErrorType.RUN_REJECTED,
        ErrorType.RUN_FAULTED,
    ):
        word = "rejected" if cause.type == ErrorType.RUN_REJECTED else "faulted"
        return f"run {word}: {cause.message}"
    return f"run failed: {cause or err}"
