"""What every harness does the same way: start a run as the docs say, and read an
orchestrator worker's logs for workflow task failures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle

from mvp_core.models import RunRequest
from temporal.client import RunHandle

__all__ = ["TASK_FAILURE_MARKS", "log_sizes", "node_output", "start_run", "task_failures"]

TASK_FAILURE_MARKS = ("Failed handling activation", "TMPRL1101")


async def start_run(client: Client, run_id: int, request: RunRequest) -> WorkflowHandle[Any, Any]:
    """Run ``run_id`` started as the hosts start it (``RunHandle.start``): its workflow."""
    return (await RunHandle.start(client, run_id, request)).workflow


def log_sizes(log_dir: Path) -> dict[Path, int]:
    """Where each orchestrator log ends now (to read only what comes after)."""
    return {log: log.stat().st_size for log in log_dir.glob("orchestrator-*.log")}


def task_failures(log_dir: Path, since: dict[Path, int] | None = None) -> list[str]:
    """Workflow task failures the orchestrator workers logged (a deadlock, a
    nondeterminism, an exception the workflow did not expect): the run may have
    recovered, but each one is a bug. ``since``: only what was logged after log_sizes()."""
    since = since or {}
    return [
        line
        for log in sorted(log_dir.glob("orchestrator-*.log"))
        for line in log.read_text(errors="replace")[since.get(log, 0) :].splitlines()
        if any(mark in line for mark in TASK_FAILURE_MARKS)
    ]


def node_output(log_path: str | None) -> str:
    """A process node's whole output: its stdout (``node.log``, the handle's log path)
    and its stderr beside it (``node.err``), one after the other."""
    if log_path is None:
        return ""
    out = []
    for path in (Path(log_path), Path(log_path).with_name("node.err")):
        if path.exists():
            out.append(path.read_text(errors="replace"))
    return "".join(out)
