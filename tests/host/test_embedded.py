"""The host commands' shared pieces: the one-per-directory lock, the worker-ready wait,
and output that a dead pipe cannot break."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.host.embedded import (
    DirLock,
    DirLockBusy,
    WorkerNotReady,
    WorkerProcess,
    wait_worker_ready,
)
from workers.stdio import SafeStream, safe


def test_a_directory_lock_is_one_holders_and_names_it(tmp_path: Path):
    path = tmp_path / "d" / "x.lock"
    first = DirLock(path)
    first.write({"pid": os.getpid(), "children": {"dev server": [1, 2.0]}})
    # flock is per open file: a second open in this process is refused like another one.
    with pytest.raises(DirLockBusy) as busy:
        DirLock(path)
    assert busy.value.holder["pid"] == os.getpid() and busy.value.path == path
    first.release()
    second = DirLock(path)
    assert second.previous["children"] == {"dev server": [1, 2.0]}  # what the last one left
    second.release()


def _worker(code: str) -> WorkerProcess:
    """A stand-in worker process that gets the ready pipe as the host's worker does; its
    code sees the pipe's write end as ``w``."""
    read_end, write_end = os.pipe()
    proc = WorkerProcess([sys.executable, "-c", f"w = {write_end}\n{code}"], pass_fds=(write_end,))
    os.close(write_end)
    os.set_blocking(read_end, False)
    proc.ready_fd = read_end
    return proc


async def test_the_worker_ready_wait_is_the_workers_own_line_on_its_pipe():
    """Issue 38 item 6: the host knows its worker polls from the worker's line on a pipe
    of its own, not from its log; an exit before it, a stop, a timeout each end the wait,
    and the pipe is closed."""
    ready = _worker("import os, time\ntime.sleep(0.2)\nos.write(w, b'ready\\n')\ntime.sleep(30)")
    try:
        assert await wait_worker_ready(ready, timeout_s=30) is True
        assert ready.ready_fd is None
    finally:
        ready.kill()
        ready.wait()
    exits = _worker("raise SystemExit(3)")
    with pytest.raises(WorkerNotReady, match="exited with 3"):
        await wait_worker_ready(exits, timeout_s=30)
    # What it prints (its log) is no signal: only its pipe is.
    talks = _worker(
        "import time\nprint('mvp-orchestrator worker ready', flush=True)\ntime.sleep(30)"
    )
    try:
        with pytest.raises(WorkerNotReady, match="did not start in 1 s"):
            await wait_worker_ready(talks, timeout_s=1)
        stopped = _worker("import time\ntime.sleep(30)")
        assert await wait_worker_ready(stopped, timeout_s=30, stop=lambda: True) is False
        stopped.kill()
        stopped.wait()
    finally:
        talks.kill()
        talks.wait()


def test_a_safe_stream_drops_what_a_dead_pipe_cannot_take():
    read, write = os.pipe()
    os.close(read)  # the reader is gone: every write fails with EPIPE
    raw = os.fdopen(write, "w", buffering=1)
    with pytest.raises(BrokenPipeError):
        raw.write("x\n")
    out = SafeStream(raw)
    assert out.write("shutting down\n") == len("shutting down\n")
    out.flush()
    assert out.broken
    assert safe(out) is out  # wrapped once
    with contextlib.suppress(OSError):
        raw.close()  # (what is still buffered cannot go anywhere either)


async def test_process_exit_is_awaited_without_polling() -> None:
    """The host learns of its worker's exit from a pidfd, with its status."""
    import sys

    from workers.host.embedded import process_exit

    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(7)"]
    )
    assert await process_exit(proc) == 7
    assert await process_exit(proc) == 7  # already gone: at once
