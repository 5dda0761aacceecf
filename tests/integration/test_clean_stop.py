"""A run that ends as asked ends quietly (issue 21, defect 3 and items 7 and 18): each
node exits with status 0 after its requested stop and no C++ abort in its log, and
the orchestrator worker's log of the finished run holds no late completion of a
cancelled activity and no unretrieved task exception."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from mvp_core import names
from mvp_core.models import Done, RequestShutdown, RunPhase, SubmitPrompt
from temporal.client import RunHandle
from tests.helpers.runs import log_sizes
from tests.helpers.waits import eventually
from tests.integration.conftest import Runs, wait_closed, wait_phase

WORKER_NOISE = ("Activity not found on completion", "Task exception was never retrieved")


def worker_log_since(log_dir: Path, since: dict[Path, int]) -> str:
    return "".join(
        log.read_text(errors="replace")[since.get(log, 0) :]
        for log in sorted(log_dir.glob("orchestrator-*.log"))
    )


async def wait_exit_records(
    node_dirs: list[Path], timeout: float = 60.0
) -> list[dict[str, object]]:
    """Each node's exit as its provider recorded it when it reaped the process."""
    files = [d / "exit.json" for d in node_dirs]
    await eventually(
        lambda: all(f.exists() for f in files),
        timeout=timeout,
        what=f"an exit record in each of {[str(d) for d in node_dirs]}",
        interval=0.2,
    )
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.parametrize("stages", [1, 2])
async def test_a_stopped_run_ends_quietly_with_every_node_exiting_0(
    runs: Runs, stages: int
) -> None:
    log_dir = runs.orchestrator.log_dir
    seen = log_sizes(log_dir)
    run_id = 2100 + stages
    handle = await runs.start(run_id, pipeline_stages=stages, default_max_tokens=16)
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    node_dirs = [
        Path(n.handle.log_path).parent for n in state.nodes if n.handle and n.handle.log_path
    ]
    assert len(node_dirs) == stages
    events = [
        ev
        async for ev in RunHandle(runs.client, run_id).stream(
            SubmitPrompt(request_id=1, prompt_text="Once upon a time")
        )
    ]
    assert isinstance(events[-1], Done) and events[-1].tokens_generated == 16
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
    await wait_closed(handle)

    exits = await wait_exit_records(node_dirs)
    logs = {d.name: (d / "node.log").read_text(errors="replace") for d in node_dirs}
    errs = {d.name: (d / "node.err").read_text(errors="replace") for d in node_dirs}
    assert [(e["status"], e["signal"]) for e in exits] == [(0, None)] * stages, (exits, logs)
    for name, text in logs.items():
        assert "stopped" in text.splitlines()[-1], (name, text[-2000:])
        err = errs[name]  # the node's stderr (its logging, a C++ abort's words)
        assert "terminate called" not in err, (name, err[-2000:])
        assert "not expected by this node" not in text + err, (name, err[-2000:])
    # The worker's last words on the run come within a few seconds of its close: a
    # window to watch for words that must not come (nothing to wait for).
    await asyncio.sleep(3.0)
    worker_log = worker_log_since(log_dir, seen)
    assert not [m for m in WORKER_NOISE if m in worker_log], worker_log[-4000:]
