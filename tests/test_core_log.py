"""The SDK core's warnings (temporal/core_log.py): through Python logging, a repeat said
once per window with the count held back, and a worker whose server is gone writes a
line per poller, not a burst per retry (issue 21, item 18)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from temporal import core_log
from temporal.core_log import RepeatFilter
from temporal.devserver import start_dev_server
from tests.helpers.waits import wait_until
from workers.host.embedded import start_worker, stop_process, worker_said_ready


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("temporalio.core", logging.WARNING, __file__, 1, msg, None, None)


def test_a_repeat_is_held_back_for_the_window_then_counted() -> None:
    now = [100.0]
    f = RepeatFilter(window_s=60, clock=lambda: now[0])
    first = _record("gRPC call poll_workflow_task_queue retried 6 times")
    assert f.filter(first)
    for n in range(7, 30):  # the same warning but for its numbers
        now[0] += 1
        assert not f.filter(_record(f"gRPC call poll_workflow_task_queue retried {n} times"))
    assert f.filter(_record("gRPC call poll_activity_task_queue retried 6 times"))  # another
    now[0] += 40  # 63 s after the first
    later = _record("gRPC call poll_workflow_task_queue retried 31 times")
    assert f.filter(later)
    assert later.getMessage() == (
        "gRPC call poll_workflow_task_queue retried 31 times "
        "(23 more like it in the last 60 s held back)"
    )
    now[0] += 61
    quiet = _record("gRPC call poll_workflow_task_queue retried 32 times")
    assert f.filter(quiet) and "held back" not in quiet.getMessage()


def test_a_long_status_dump_is_cut() -> None:
    f = RepeatFilter()
    r = _record("x" * 5000)
    assert f.filter(r)
    assert len(r.getMessage()) == core_log.MAX_MESSAGE + 1


def test_a_worker_whose_server_is_gone_says_so_once_per_poller(tmp_path: Path) -> None:
    srv = start_dev_server(str(tmp_path / "t.db"), log_file=str(tmp_path / "temporal.log"))
    log = tmp_path / "worker.log"
    worker = start_worker(srv.address, tmp_path, log, {"MVP_REAPER_INTERVAL_S": "0"})
    try:

        def ready() -> bool:
            assert worker.poll() is None, log.read_text() + _tail(tmp_path / "temporal.log")
            return worker_said_ready(log)

        def warned() -> bool:
            assert worker.poll() is None, log.read_text()
            return "temporalio.core WARNING" in log.read_text()

        wait_until(ready, timeout=120, what="the worker to say it is ready", interval=0.2)
        srv.stop()
        # The core retries each poll every fraction of a second to a few seconds: wait
        # for its first warnings, then watch a window of a dozen retries more (the
        # behaviour under test: one line per poller in it, not a burst per retry).
        wait_until(warned, timeout=120, what="the core's first warning", interval=0.2)
        time.sleep(15)
        text = log.read_text()
    finally:
        stop_process(worker, 10)
        srv.stop()
    core = [line for line in text.splitlines() if "temporalio.core" in line]
    calls = [re.search(r"gRPC call (\w+)", line) for line in core]
    # A poll's line says how often it was retried; the worker's periodic heartbeat (it
    # may be the only line in a window on a loaded machine) says it failed.
    assert core and all(
        m is not None and ("retried" in line or m.group(1).startswith("record_worker_heart"))
        for m, line in zip(calls, core, strict=True)
    ), core
    kinds = [m.group(1) for m in calls if m is not None]
    # One line per call kind in the window, not a burst per retry: the pollers (workflow,
    # activity, nexus) and, when its period falls in the window, the worker's heartbeat.
    assert len(kinds) == len(set(kinds)), core
    assert any(k.startswith("poll_") for k in kinds), core
    assert all(k.startswith("poll_") or k == "record_worker_heartbeat" for k in kinds), core
    assert "\x1b[" not in text  # no terminal colour codes in a log file
    assert not re.search(r"^\S*\s*WARN\s", text, re.M), text[-2000:]  # nothing raw on stderr


def _tail(path: Path) -> str:
    """The dev server's last words, for a failure's message."""
    return "\nthe dev server's log: " + (path.read_text()[-2000:] if path.exists() else "(none)")
