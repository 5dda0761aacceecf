"""The one pid record of the providers (activities/providers/pidstart.py): the process
provider's pid.json and the Vast.ai provider's tunnel.json are written, read and checked
by the same functions, against real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from activities.providers.pidstart import (
    ProcessStart,
    read_record,
    recorded_alive,
    start_ticks,
    write_record,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="procfs")


def test_a_written_record_reads_back_as_the_same_start(
    tmp_path: Path, live: subprocess.Popen[bytes]
) -> None:
    start = ProcessStart.of(psutil.Process(live.pid))
    write_record(tmp_path / "tunnel.json", live.pid, start)
    assert not (tmp_path / "tunnel.tmp").exists()  # written whole, then renamed
    assert json.loads((tmp_path / "tunnel.json").read_text()) == {
        "pid": live.pid,
        "create_time": start.create_time,
        "start_ticks": start_ticks(live.pid),
    }
    assert read_record(tmp_path / "tunnel.json") == (live.pid, start)
    alive = recorded_alive(tmp_path / "tunnel.json")
    assert alive is not None and alive.pid == live.pid


def test_a_tunnel_record_of_the_older_layout_still_names_its_process(
    tmp_path: Path, live: subprocess.Popen[bytes]
) -> None:
    """The Vast.ai tunnel's record before it was this one (``started``): a tunnel opened
    before an upgrade is still found, so it is closed, not left running."""
    proc = psutil.Process(live.pid)
    old = {"pid": live.pid, "started": proc.create_time(), "start_ticks": start_ticks(live.pid)}
    (tmp_path / "tunnel.json").write_text(json.dumps(old))
    alive = recorded_alive(tmp_path / "tunnel.json")
    assert alive is not None and alive.pid == live.pid


def test_no_live_process_for_a_gone_or_reused_pid_or_no_record(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    start = ProcessStart.of(psutil.Process(gone.pid))
    gone.wait(30)
    write_record(tmp_path / "gone.json", gone.pid, start)
    assert recorded_alive(tmp_path / "gone.json") is None
    # a pid that is alive now, recorded with another process's start: a reused pid
    me = psutil.Process()
    other = ProcessStart(me.create_time() - 100, (start_ticks(me.pid) or 0) - 10_000)
    write_record(tmp_path / "reused.json", me.pid, other)
    assert recorded_alive(tmp_path / "reused.json") is None
    # a record with no start is no proof of a process; no record, a torn one: none
    (tmp_path / "nostart.json").write_text(json.dumps({"pid": me.pid}))
    assert read_record(tmp_path / "nostart.json") == (me.pid, None)
    assert recorded_alive(tmp_path / "nostart.json") is None
    assert recorded_alive(tmp_path / "missing.json") is None
    (tmp_path / "torn.json").write_text('{"pid": ')
    assert read_record(tmp_path / "torn.json") is None
