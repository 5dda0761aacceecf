"""The embedded default of the host commands (the demo, ``mvp-orchestrator``): an
orchestrator worker process they own next to a local dev server, how to wait for it and
stop both, and the one-per-directory lock that keeps two of them off one database."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from mvp_core import names
from mvp_core.errors import ErrorType
from mvp_core.models import ProviderKind
from mvp_core.names import parse_resource_name
from mvp_io.node_processes import marked_node_processes
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


# Node directories (``<state_dir>/nodes/mvp-<run_id>-<node_id>-<nonce8>``, each with its
# node's log) of this many most recent runs survive a host's start; older ones of runs
# whose nodes are gone are removed. Young ones stay whatever their run: a worker of
# another host may be starting that node right now.
KEEP_NODE_RUNS = 5
PRUNE_MIN_AGE_S = 600.0


def prune_node_dirs(
    state_dir: Path, keep_runs: int = KEEP_NODE_RUNS, min_age_s: float = PRUNE_MIN_AGE_S
) -> list[str]:
    """Remove the node directories of old runs that no live node uses; their names.

    A run's age is its newest directory's; the ``keep_runs`` newest runs are kept whole,
    and so is any directory younger than ``min_age_s`` or with a live node process."""
    root = state_dir / "nodes"
    found: list[tuple[Path, int, float]] = []  # (directory, run_id, mtime)
    try:
        for d in root.iterdir():
            parsed = parse_resource_name(d.name)
            with contextlib.suppress(FileNotFoundError):
                if parsed is not None and d.is_dir():
                    found.append((d, parsed[0], d.stat().st_mtime))
    except FileNotFoundError:
        return []
    live = marked_node_processes(root)
    newest: dict[int, float] = {}
    for _, run_id, mtime in found:
        newest[run_id] = max(newest.get(run_id, 0.0), mtime)
    kept = set(sorted(newest, key=lambda r: newest[r], reverse=True)[:keep_runs])
    now = time.time()
    removed: list[str] = []
    for d, run_id, mtime in sorted(found):
        if run_id in kept or d.name in live or now - mtime < min_age_s:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d.name)
    return removed


def dev_server_ip(provider: ProviderKind) -> str:
    """Where an embedded dev server listens: loopback, except for Docker nodes, which
    reach it through their run network's gateway (docs/docker.md)."""
    return "0.0.0.0" if provider is ProviderKind.DOCKER else "127.0.0.1"


class WorkerProcess(subprocess.Popen[bytes]):
    """The embedded orchestrator worker's process, and the read end of the pipe on which
    it says it is ready (``MVP_READY_FD``)."""

    ready_fd: int | None = None


def start_worker(
    address: str, state_dir: Path, log_path: Path, extra_env: Mapping[str, str] | None = None
) -> WorkerProcess:
    """``python -m workers.orchestrator`` on the local dev server at ``address``, dying
    with this process, its output in ``log_path``. Its own process group: a terminal's
    Ctrl-C reaches the host alone, which stops the run while the worker can still run
    the run's teardown. It connects in plaintext to namespace default, whatever Temporal
    settings (TLS, API key, profile) this process's environment holds. It says it is
    ready on a pipe of its own (``wait_worker_ready``)."""
    read_end, write_end = os.pipe()
    env = {
        **local_server_env(address),
        "PYTHONUNBUFFERED": "1",
        # Node directories, the cwd of node processes, live in the host's state directory.
        "MVP_STATE_DIR": str(state_dir),
        **(extra_env or {}),
        names.WORKER_READY_FD_ENV: str(write_end),
    }
    cmd = [sys.executable, "-m", "workers.orchestrator"]
    if sys.platform.startswith("linux"):
        cmd = [sys.executable, "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *cmd]
    try:
        with open(log_path, "ab") as out:
            proc = WorkerProcess(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                process_group=0,
                pass_fds=(write_end,),
            )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)  # the worker's alone now: its exit is this pipe's end
    os.set_blocking(read_end, False)
    proc.ready_fd = read_end
    return proc


async def process_exit(proc: subprocess.Popen[bytes]) -> int:
    """``proc``'s exit status, once it has exited: awaited on a pidfd (readable at the
    child's exit), so nothing polls."""
    if proc.poll() is not None:
        return proc.returncode
    fd = os.pidfd_open(proc.pid)
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return proc.wait()


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


class DirLockBusy(Exception):
    """Another process holds the directory's lock; ``holder`` is what it wrote there."""

    def __init__(self, path: Path, holder: dict[str, Any]) -> None:
        super().__init__(f"{path} is locked by pid {holder.get('pid', 'unknown')}")
        self.path = path
        self.holder = holder


class DirLock:
    """One process per directory (its dev server's SQLite database allows one server):
    an exclusive ``flock`` on ``path``, taken at once or not at all. The kernel drops it
    when the holder ends, however it ends. The file holds a small JSON record of the
    holder (its pid, and whatever :meth:`write` adds), for the next one to read."""

    def __init__(self, path: Path, mode: int = 0o644) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            raise DirLockBusy(path, holder) from None
        self.path = path
        self._fd = fd
        self.previous = _read_record(fd)  # what the last holder left
        self.write({"pid": os.getpid()})

    def write(self, record: dict[str, Any]) -> None:
        data = json.dumps(record).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def _read_record(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


# What workers.orchestrator also logs once it polls (for the harnesses that start it
# themselves; the host waits on its pipe).
WORKER_READY_LINE = "worker ready"


class WorkerNotReady(Exception):
    """The orchestrator worker exited, or did not say it was ready in time."""


async def wait_worker_ready(
    proc: WorkerProcess,
    *,
    timeout_s: float = 60.0,
    stop: Callable[[], bool] | None = None,
) -> bool:
    """Wait until the worker ``proc`` says on its pipe that it polls: True. False when
    ``stop()`` turned true first. Raises WorkerNotReady when the worker exits (its pipe
    ends without the line) or ``timeout_s`` passes. The pipe is closed either way."""
    fd = proc.ready_fd
    if fd is None:
        raise WorkerNotReady("the orchestrator worker has no ready pipe")
    deadline = time.monotonic() + timeout_s
    said = b""
    try:
        while True:
            try:
                chunk: bytes | None = os.read(fd, 64)
            except BlockingIOError:
                chunk = None
            if chunk is not None:
                said += chunk
                if b"ready\n" in said:
                    return True
                if chunk == b"":  # every writer gone: the worker exited first
                    code = proc.wait(timeout=10) if proc.poll() is None else proc.returncode
                    raise WorkerNotReady(f"the orchestrator worker exited with {code}")
            if time.monotonic() > deadline:
                raise WorkerNotReady(f"the orchestrator worker did not start in {timeout_s:.0f} s")
            if stop is not None and stop():
                return False
            await asyncio.sleep(0.05)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
        proc.ready_fd = None


def worker_said_ready(log_path: Path, offset: int = 0) -> bool:
    """Whether the orchestrator worker's log, past ``offset``, says it is ready."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            return WORKER_READY_LINE in f.read().decode(errors="replace")
    except FileNotFoundError:
        return False
