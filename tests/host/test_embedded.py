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
    wait_worker_ready,
    worker_said_ready,
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


async def test_the_worker_ready_wait_reads_past_the_offset_and_sees_an_exit(tmp_path: Path):
    log = tmp_path / "orchestrator.log"
    log.write_text("old run: mvp-orchestrator worker ready\n")
    offset = log.stat().st_size
    assert worker_said_ready(log) and not worker_said_ready(log, offset)
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(WorkerNotReady, match="exited with 3"):
        await wait_worker_ready(proc, log, offset=offset, timeout_s=30)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert await wait_worker_ready(alive, log, offset=offset, stop=lambda: True) is False
        with log.open("a") as f:
            f.write("mvp-orchestrator worker ready: mvp-orchestrator\n")
        assert await wait_worker_ready(alive, log, offset=offset, timeout_s=30) is True
    finally:
        alive.kill()
        alive.wait()


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
    import subprocess
    import sys

    from workers.host.embedded import process_exit

    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(7)"]
    )
    assert await process_exit(proc) == 7
    assert await process_exit(proc) == 7  # already gone: at once
