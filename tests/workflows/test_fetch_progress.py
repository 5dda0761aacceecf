"""A node share's fetch progress, from its start activity's heartbeat to what the
dashboard and a client's ``RunHandle.fetches()`` read of the run (DECISIONS 79): through a
real server's describe, with the project's data converter."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from mvp_core import names
from temporal.client import RunHandle
from tests.helpers.waits import eventually
from workers.dashboard.sources import TemporalSource

RELEASE = asyncio.Event()


@activity.defn(name=names.ACT_START_NODE)
async def start_node_fetching() -> None:
    """What ShareProgress.details gives the start activity's heartbeat, mid-fetch."""
    while not RELEASE.is_set():
        details = {"node_id": 4, "stage_index": 2, "model": "acme/m-GGUF m.gguf at abc"}
        details |= {"bytes_held": 3_000_000, "bytes_total": 8_000_000, "seconds": 1.5}
        activity.heartbeat({"fetch": details})
        await asyncio.sleep(0.1)


@workflow.defn(sandboxed=False)
class StartsOneNode:
    @workflow.run
    async def run(self) -> None:
        await workflow.execute_activity(
            names.ACT_START_NODE,
            start_to_close_timeout=timedelta(minutes=5),
            heartbeat_timeout=timedelta(minutes=1),
        )


async def test_the_dashboard_reads_a_fetchs_progress_from_the_start_activitys_heartbeat(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    RELEASE.clear()
    source = TemporalSource(env.client)
    async with Worker(
        env.client,
        task_queue=task_queue,
        workflows=[StartsOneNode],
        activities=[start_node_fetching],
    ):
        run_id = 900_000 + sum(map(ord, task_queue)) % 99_999
        handle = await env.client.start_workflow(
            StartsOneNode.run, id=names.run_workflow_id(run_id), task_queue=task_queue
        )

        async def seen() -> dict[int, tuple[int, int]] | None:
            return await source.fetches(handle.id) or None

        assert await eventually(seen, timeout=30, what="the fetch's progress") == {
            4: (3_000_000, 8_000_000)
        }
        assert await RunHandle(env.client, run_id).fetches() == {4: (3_000_000, 8_000_000)}
        RELEASE.set()
        await handle.result()
    assert await source.fetches(handle.id) == {}  # nothing pending: no progress
    assert await RunHandle(env.client, run_id).fetches() == {}
