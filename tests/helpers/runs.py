"""What every harness does the same way: start a run as the docs say, and read an
orchestrator worker's logs for workflow task failures."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle

from mvp_core import names
from mvp_core.models import RunRequest

TASK_FAILURE_MARKS = ("Failed handling activation", "TMPRL1101")


async def start_run(client: Client, run_id: int, request: RunRequest) -> WorkflowHandle[Any, Any]:
    """Start run ``run_id`` with the 5 s workflow task timeout the harnesses use."""
    handle: WorkflowHandle[Any, Any] = await client.start_workflow(
        names.RUN_WORKFLOW,
        request,
        id=names.run_workflow_id(run_id),
        task_queue=names.ORCHESTRATOR_TASK_QUEUE,
        task_timeout=timedelta(seconds=names.WORKFLOW_TASK_TIMEOUT_S),
    )
    return handle


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
