"""Two deployments on one host share its state directory (issue 38, item 11; DECISIONS
97): the default one, as a by-hand worker beside an ``mvp-orchestrator`` has it. Each
works for its own Temporal server or namespace, whose reaper knows only its own runs:
a sweep must leave the other deployment's live node alone and still remove its own
orphan. Real process-provider starts, of a stand-in for the node agent."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from activities.providers.process import ProcessProvider
from mvp_core.models import NodeHandle, NodeProvisionSpec
from mvp_core.reaper import Liveness, RunLiveness, decide, run_ids_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="procfs")


def spec(run_id: int, nonce: str) -> NodeProvisionSpec:
    return NodeProvisionSpec(
        run_id=run_id,
        node_id=1,
        stage_index=0,
        nonce=nonce,
        task_queue=f"mvp-node-{run_id}-1-{nonce[:8]}",
        readiness_id="r",
        authorized_orchestrator="o",
        run_workflow_id=f"mvp-run-{run_id}",
        coordinator_endpoint="",
    )


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    """A "python" that runs as a node would (its command line marked, in its node
    directory) and does nothing but wait."""
    path = tmp_path / "node-stand-in"
    path.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(120)\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def started() -> Iterator[list[NodeHandle]]:
    handles: list[NodeHandle] = []
    yield handles
    for h in handles:  # whatever a failed test left running
        if h.pid is not None and psutil.pid_exists(h.pid):
            try:
                os.killpg(h.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def deployment(monkeypatch: pytest.MonkeyPatch, address: str, namespace: str) -> None:
    """This process as a worker of the deployment on ``address``, ``namespace``."""
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("TEMPORAL_ADDRESS", address)
    monkeypatch.setenv("TEMPORAL_NAMESPACE", namespace)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sweep(provider: ProcessProvider) -> list[str]:
    """One sweep, as the ReaperWorkflow makes it, by a deployment whose Temporal knows
    none of the runs listed (every one is absent there); the names it destroyed."""
    listed = provider.list_resources()
    plan = decide(listed, {r: RunLiveness(state=Liveness.ABSENT) for r in run_ids_of(listed)})
    for d in plan.destroy:
        provider.destroy(d.resource)
    return [d.resource.name for d in plan.destroy]


@pytest.mark.parametrize(
    "b_address, b_namespace",
    [("127.0.0.1:7302", "default"), ("127.0.0.1:7301", "other")],
    ids=["another-server", "another-namespace"],
)
def test_a_sweep_leaves_another_deployments_node_and_removes_its_own_orphan(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stand_in: Path,
    started: list[NodeHandle],
    b_address: str,
    b_namespace: str,
) -> None:
    monkeypatch.setenv("MVP_STATE_DIR", str(tmp_path / "state"))  # one, shared
    deployment(monkeypatch, "127.0.0.1:7301", "default")
    a = ProcessProvider(python=str(stand_in), host="h")
    a_node = a.start(spec(7, "aaaaaaaa11111111"))
    started.append(a_node)
    deployment(monkeypatch, b_address, b_namespace)
    b = ProcessProvider(python=str(stand_in), host="h")
    b_node = b.start(spec(8, "bbbbbbbb22222222"))  # its run is gone: an orphan
    started.append(b_node)
    assert a_node.pid is not None and b_node.pid is not None
    assert alive(a_node.pid) and alive(b_node.pid)

    # B's sweep: A's run is unknown to B's Temporal, yet A's live node is not B's to judge.
    assert sweep(b) == [b_node.resource_name]
    assert alive(a_node.pid), "deployment B's reaper destroyed deployment A's live node"
    assert not alive(b_node.pid)
    assert b.list_resources() == []

    # Asked outright, B still leaves A's node alone.
    deployment(monkeypatch, "127.0.0.1:7301", "default")
    [a_resource] = a.list_resources()  # A lists its own node alone (not B's record)
    assert a_resource.name == a_node.resource_name and a_resource.run_workflow_id == "mvp-run-7"
    with pytest.raises(RuntimeError, match="not this deployment's"):
        b.destroy(a_resource)
    assert alive(a_node.pid)

    # A's own sweep, once its run is gone too, removes it.
    assert sweep(a) == [a_node.resource_name]
    assert not alive(a_node.pid)
