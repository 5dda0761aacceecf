"""The process provider declares a node gone only when it is (issue 21, defect 2): a
clock step moves psutil's create time of every process (boot time from the wall clock,
in whole seconds) but not the kernel's start ticks, so a live node stays alive across a
step, while an exited node and a later process of a reused pid are gone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from psutil import _pslinux

from activities.providers.pidstart import ProcessStart
from activities.providers.process import ProcessProvider, write_run_record
from mvp_core.models import NodeHandle, ProviderKind

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="procfs")


def kernel_start_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 1 :].split()[19])  # field 22


def record(node_dir: Path, pid: int, **start: float | int) -> NodeHandle:
    """A started node as the provider records it: pid.json beside node.log."""
    node_dir.mkdir(parents=True, exist_ok=True)
    (node_dir / "pid.json").write_text(json.dumps({"pid": pid, **start}))
    (node_dir / "node.log").write_text("node 1 stage 0 serving\n")
    return NodeHandle(
        run_id=1,
        node_id=1,
        provider=ProviderKind.PROCESS,
        host="h",
        pid=pid,
        log_path=str(node_dir / "node.log"),
        resource_name=node_dir.name,
    )


def step_clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The boot time /proc/stat reports after the wall clock was stepped by ``seconds``."""
    booted = _pslinux.boot_time()
    monkeypatch.setattr(_pslinux, "boot_time", lambda: booted + seconds)


@pytest.mark.parametrize("step_s", [1.0, -1.0, 37.0])
def test_a_live_node_stays_alive_when_the_clock_is_stepped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, live: subprocess.Popen[bytes], step_s: float
) -> None:
    monkeypatch.setenv("MVP_STATE_DIR", str(tmp_path))
    proc = psutil.Process(live.pid)
    handle = record(
        tmp_path / "nodes" / "mvp-1-1-aaaaaaaa",
        live.pid,
        create_time=proc.create_time(),
        start_ticks=kernel_start_ticks(live.pid),
    )
    provider = ProcessProvider(host="h")
    write_run_record(tmp_path / "nodes" / "mvp-1-1-aaaaaaaa", "mvp-run-1", provider.scope)
    assert provider.poll_exited([handle]) is None
    step_clock(monkeypatch, step_s)
    assert psutil.Process(live.pid).create_time() != proc.create_time()  # the step shows
    assert provider.poll_exited([handle]) is None
    # The reaper's sweep sees it live too (so does a stop: it signals it).
    assert [r.detail for r in provider.list_resources()] == [f"live, pid {live.pid} (recorded)"]


def test_an_exited_node_is_gone(tmp_path: Path, live: subprocess.Popen[bytes]) -> None:
    start = {
        "create_time": psutil.Process(live.pid).create_time(),
        "start_ticks": kernel_start_ticks(live.pid),
    }
    handle = record(tmp_path / "mvp-1-1-aaaaaaaa", live.pid, **start)
    live.kill()
    live.wait(10)
    exited = ProcessProvider(host="h").poll_exited([handle])
    assert exited is not None and exited.node_id == 1
    assert exited.detail == (f"process {live.pid} is gone; last log line: node 1 stage 0 serving")


def test_a_reused_pid_is_not_the_recorded_node(
    tmp_path: Path, live: subprocess.Popen[bytes]
) -> None:
    # The record of an earlier process of this pid: started 2 s (200 ticks) before it,
    # whatever the clock says now.
    proc = psutil.Process(live.pid)
    handle = record(
        tmp_path / "mvp-1-1-aaaaaaaa",
        live.pid,
        create_time=proc.create_time(),
        start_ticks=kernel_start_ticks(live.pid) - 200,
    )
    exited = ProcessProvider(host="h").poll_exited([handle])
    assert exited is not None and f"process {live.pid} is gone" in exited.detail


def test_a_record_without_start_ticks_still_guards_against_pid_reuse(
    tmp_path: Path, live: subprocess.Popen[bytes]
) -> None:
    """A record written before the ticks were kept: its create time decides."""
    created = psutil.Process(live.pid).create_time()
    provider = ProcessProvider(host="h")
    same = record(tmp_path / "mvp-1-1-aaaaaaaa", live.pid, create_time=created)
    assert provider.poll_exited([same]) is None
    earlier = record(tmp_path / "mvp-1-2-aaaaaaaa", live.pid, create_time=created - 5)
    assert provider.poll_exited([earlier]) is not None


def test_a_started_node_records_its_kernel_start_ticks(
    tmp_path: Path, live: subprocess.Popen[bytes]
) -> None:
    """What the provider writes when it adopts a running node: both marks."""
    ProcessProvider._record(
        tmp_path / "pid.json", live.pid, ProcessStart.of(psutil.Process(live.pid))
    )
    rec = json.loads((tmp_path / "pid.json").read_text())
    assert rec["pid"] == live.pid
    assert rec["start_ticks"] == kernel_start_ticks(live.pid)
    assert rec["create_time"] == pytest.approx(psutil.Process(live.pid).create_time())
