"""The reaper (DECISIONS 30): it sweeps by what the provider reports and destroys what
belongs to a closed or unknown run, or to another execution of a running one; a live
run's nodes are kept, and a second sweep finds nothing more to do."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from temporalio.client import (
    Client,
    ScheduleActionExecutionStartWorkflow,
    ScheduleActionStartWorkflow,
    ScheduleOverlapPolicy,
)

from activities.planning import provider_host
from activities.providers.pidstart import ProcessStart
from activities.providers.process import ProcessProvider, write_run_record
from mvp_core import names
from mvp_core.models import RequestShutdown, RunOutcome, RunPhase
from mvp_core.reaper import ReapDecision, ReapReport
from tests.helpers.waits import eventually, wait_until
from tests.integration.conftest import (
    OrchestratorProcess,
    Runs,
    node_pids,
    node_processes,
    snapshot,
    wait_closed,
    wait_phase,
)
from workers.orchestrator.reaper_schedule import ensure_reaper_schedule, reaper_interval_s

# ---------------------------------------------------------------- the process provider


def gone_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# The deployment (Temporal address, namespace) the provider tests' nodes were started by.
SCOPE = ("localhost:7233", "default")


def fake_node(
    cwd: Path, name: str, scope: tuple[str, str] | None = SCOPE
) -> subprocess.Popen[bytes]:
    """A process marked like a node agent, in ``cwd``, in its own session, recorded as
    started by the deployment ``scope`` (None: no record)."""
    cwd.mkdir(parents=True, exist_ok=True)
    if scope is not None:
        write_run_record(cwd, names.run_workflow_id(parse_run_id(name)), scope)
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(120)",
            "workers.node",
            f"--resource={name}",
        ],
        cwd=str(cwd),
        start_new_session=True,
    )


def parse_run_id(name: str) -> int:
    parsed = names.parse_resource_name(name)
    assert parsed is not None
    return parsed[0]


def dead_record(nodes: Path, name: str, scope: tuple[str, str] = SCOPE) -> Path:
    """The records of a node of deployment ``scope`` whose process is gone."""
    node_dir = nodes / name
    node_dir.mkdir(parents=True)
    write_run_record(node_dir, names.run_workflow_id(parse_run_id(name)), scope)
    (node_dir / "pid.json").write_text(json.dumps({"pid": gone_pid(), "create_time": 1.0}))
    (node_dir / "node.log").write_text("node 1 stage 0 serving\n")
    return node_dir


def wait_gone(pid: int, timeout: float = 20.0) -> bool:
    """True once process ``pid`` is gone (or a zombie); AssertionError after ``timeout``."""

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return wait_until(gone, timeout=timeout, what=f"process {pid} to be gone")


def test_process_provider_lists_its_marked_nodes_and_dead_records_and_destroys_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    nodes = state / "nodes"
    monkeypatch.setenv("MVP_STATE_DIR", str(state))
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("TEMPORAL_ADDRESS", SCOPE[0])
    monkeypatch.setenv("TEMPORAL_NAMESPACE", SCOPE[1])
    provider = ProcessProvider(host="h1")
    live = fake_node(nodes / "mvp-7001-1-aaaaaaaa", "mvp-7001-1-aaaaaaaa")
    unrecorded = fake_node(nodes / "mvp-7001-2-aaaaaaaa", "mvp-7001-2-aaaaaaaa")
    # Another state directory's node (another deployment on this host): not ours.
    foreign = fake_node(tmp_path / "other" / "nodes" / "mvp-7003-1-cccccccc", "mvp-7003-1-cccccccc")
    # Nodes in this state directory that this deployment did not start (DECISIONS 97):
    # another deployment's, and one whose record names none (an older release's).
    neighbour = fake_node(
        nodes / "mvp-7005-1-eeeeeeee", "mvp-7005-1-eeeeeeee", ("localhost:7234", "default")
    )
    unscoped = fake_node(nodes / "mvp-7006-1-ffffffff", "mvp-7006-1-ffffffff", None)
    try:
        ProcessProvider._record(
            nodes / "mvp-7001-1-aaaaaaaa" / "pid.json",
            live.pid,
            ProcessStart.of(psutil.Process(live.pid)),
        )
        dead = dead_record(nodes, "mvp-7002-1-bbbbbbbb")
        (nodes / "mvp-7004-1-dddddddd").mkdir()  # a start in flight: nothing recorded yet
        (nodes / "not-a-node").mkdir()

        listed = provider.list_resources()
        assert [(r.name, r.run_workflow_id, r.nonce8) for r in listed] == [
            ("mvp-7001-1-aaaaaaaa", "mvp-run-7001", "aaaaaaaa"),
            ("mvp-7001-2-aaaaaaaa", "mvp-run-7001", "aaaaaaaa"),
            ("mvp-7002-1-bbbbbbbb", "mvp-run-7002", "bbbbbbbb"),
        ]
        assert all(r.kind == "process" and r.host == "h1" for r in listed)
        assert listed[0].detail == f"live, pid {live.pid}"
        assert listed[1].detail == f"live, pid {unrecorded.pid}"
        assert listed[2].detail.startswith("dead: ")

        for resource in listed:
            provider.destroy(resource)
        # (the provider reaps its children itself: Popen sees no exit status)
        assert wait_gone(live.pid) and wait_gone(unrecorded.pid)
        assert not (nodes / "mvp-7001-1-aaaaaaaa" / "pid.json").exists()
        assert not (dead / "pid.json").exists() and (dead / "node.log").exists()
        assert foreign.poll() is None and neighbour.poll() is None and unscoped.poll() is None
        assert provider.list_resources() == []
        for resource in listed:
            provider.destroy(resource)  # idempotent: gone is success
    finally:
        for proc in (live, unrecorded, foreign, neighbour, unscoped):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


# ---------------------------------------------------------------- the reaper, end to end


async def sweep(client: Client, schedule_id: str, timeout: float = 90.0) -> ReapReport:
    """Trigger the schedule and return the report of the sweep it started."""
    handle = client.get_schedule_handle(schedule_id)
    # By run id too: two sweeps in one second share a workflow id (the schedule's
    # ids have second resolution).
    seen = {
        (a.action.workflow_id, a.action.first_execution_run_id)
        for a in (await handle.describe()).info.recent_actions
        if isinstance(a.action, ScheduleActionExecutionStartWorkflow)
    }
    await handle.trigger()
    deadline = time.monotonic() + timeout

    async def started() -> ScheduleActionExecutionStartWorkflow | None:
        for a in (await handle.describe()).info.recent_actions:
            action = a.action
            if isinstance(action, ScheduleActionExecutionStartWorkflow) and (
                (action.workflow_id, action.first_execution_run_id) not in seen
            ):
                return action
        return None

    action = await eventually(
        started, timeout=timeout, what=f"{schedule_id} to start a sweep", interval=0.2
    )
    wf = client.get_workflow_handle(
        action.workflow_id, run_id=action.first_execution_run_id, result_type=ReapReport
    )
    report: ReapReport = await asyncio.wait_for(wf.result(), max(deadline - time.monotonic(), 1))
    return report


def by_name(decisions: list[ReapDecision]) -> dict[str, str]:
    return {d.resource.name: d.reason for d in decisions}


async def test_the_reaper_destroys_what_closed_runs_left_and_keeps_a_live_run(
    runs: Runs, client: Client, state_dir: Path, orchestrator: OrchestratorProcess
) -> None:
    host = provider_host()
    schedule_id = names.reaper_schedule_id(host)
    # The orchestrator worker made its host's schedule when it started (the harness's
    # interval: a day, so only a trigger sweeps during the tests).
    desc = await client.get_schedule_handle(schedule_id).describe()
    assert [i.every.total_seconds() for i in desc.schedule.spec.intervals] == [86400]
    assert desc.schedule.policy.overlap == ScheduleOverlapPolicy.SKIP

    closing = await runs.start(1801)
    live = await runs.start(1802)
    closing_state = await wait_phase(closing, RunPhase.PROMPT_READY)
    live_state = await wait_phase(live, RunPhase.PROMPT_READY)
    closing_node = f"mvp-1801-1-{closing_state.nonce[:8]}"
    live_node = f"mvp-1802-1-{live_state.nonce[:8]}"
    nodes = state_dir / "nodes"
    # What a provider may hold without a process: the records of an unknown run, and of
    # another execution of the live run.
    scope = (orchestrator.address.lower(), "default")
    unknown = dead_record(nodes, "mvp-1809-1-deadbeef", scope)
    stale = dead_record(nodes, "mvp-1802-7-0badc0de", scope)

    # Terminated: no teardown runs. Frozen, the node cannot leave by its dead-man switch
    # (nor act on SIGTERM): only the reaper's kill ends it.
    pid = node_pids(closing_state)[0]
    os.kill(pid, signal.SIGSTOP)
    await closing.terminate("test: leave the node behind")
    await wait_closed(closing)

    report = await sweep(client, schedule_id)
    destroyed = by_name(report.destroyed)
    assert destroyed[closing_node] == "run mvp-run-1801 is closed (terminated)", report
    assert destroyed["mvp-1809-1-deadbeef"] == "run mvp-run-1809 does not exist"
    assert destroyed["mvp-1802-7-0badc0de"].startswith(
        f"run mvp-run-1802 is running another execution ({live_state.nonce[:8]}"
    )
    assert by_name(report.kept)[live_node].startswith("run mvp-run-1802 is running this execution")
    assert report.failed == [], report.failed
    assert report.host == host and report.listed >= 4
    assert wait_gone(pid)
    assert pid not in [p.pid for p in node_processes(state_dir)]
    assert not (unknown / "pid.json").exists() and (unknown / "node.log").exists()
    assert not (stale / "pid.json").exists()
    assert not (nodes / closing_node / "pid.json").exists()
    assert (await snapshot(live)).phase == RunPhase.PROMPT_READY  # untouched

    again = await sweep(client, schedule_id)
    assert again.destroyed == [] and again.failed == [], again
    assert live_node in by_name(again.kept)

    await live.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=1802))
    outcome = RunOutcome.model_validate(await live.result())
    assert outcome.outcome.value == "operator_stopped", outcome


# ---------------------------------------------------------------- the schedule


def test_the_interval_comes_from_the_environment() -> None:
    assert reaper_interval_s({}) == 60
    assert reaper_interval_s({"MVP_REAPER_INTERVAL_S": " 0 "}) == 0
    assert reaper_interval_s({"MVP_REAPER_INTERVAL_S": "15"}) == 15
    for bad in ("-1", "1.5", "soon"):
        with pytest.raises(ValueError, match="MVP_REAPER_INTERVAL_S"):
            reaper_interval_s({"MVP_REAPER_INTERVAL_S": bad})


async def test_workers_make_one_schedule_and_bring_its_interval_in_line(client: Client) -> None:
    host = "reaper-test-host"
    handle = client.get_schedule_handle(names.reaper_schedule_id(host))
    try:
        # Two workers of one host start at once: one schedule, made once.
        said = await asyncio.gather(
            ensure_reaper_schedule(client, host, 120), ensure_reaper_schedule(client, host, 120)
        )
        assert sorted(s.split()[3] for s in said) == ["created:", "exists:"], said
        assert "left alone" in await ensure_reaper_schedule(client, host, 0)
        await handle.pause(note="an operator's pause")
        assert "updated" in await ensure_reaper_schedule(client, host, 300)
        desc = await handle.describe()
        assert [i.every.total_seconds() for i in desc.schedule.spec.intervals] == [300]
        assert desc.schedule.state.paused  # the operator's pause is kept
        assert desc.schedule.policy.overlap == ScheduleOverlapPolicy.SKIP
        action = desc.schedule.action
        assert isinstance(action, ScheduleActionStartWorkflow)
        assert action.workflow == names.REAPER_WORKFLOW and action.id == f"mvp-reaper-{host}"
        assert action.task_queue == names.ORCHESTRATOR_TASK_QUEUE
        assert "exists" in await ensure_reaper_schedule(client, host, 300)
    finally:
        await handle.delete()


async def test_a_provider_this_host_cannot_use_is_logged_once_per_worker(
    client: Client, orchestrator: OrchestratorProcess
) -> None:
    """Issue 21, item 18: the harness's worker has no Vast.ai key. Every sweep still
    reports the provider as not swept (in its result), but the worker's log says so once,
    not once per sweep (every minute, by default)."""
    schedule_id = names.reaper_schedule_id(provider_host())
    for _ in range(3):
        report = await sweep(client, schedule_id)
        assert [u for u in report.unavailable if u.startswith("vastai: VASTAI_API_KEY")], report
    log = orchestrator.log_dir / f"orchestrator-{orchestrator.starts}.log"
    said = [
        line
        for line in log.read_text(errors="replace").splitlines()
        if "not swept" in line and "vastai" in line
    ]
    assert len(said) == 1, said
    assert "provider vastai is not swept on this host (VASTAI_API_KEY is required" in said[0]
