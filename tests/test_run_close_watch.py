"""RunHandle.wait_closed: one long poll of the run's close (what mvp-gateway waits on to
exit with its run), through continue-as-new, whatever way the run ends."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from temporalio import workflow
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.worker import Worker

from temporal.client import RunHandle
from temporal.connect import connect
from temporal.devserver import DevServer, start_dev_server
from tests.helpers.waits import eventually


@workflow.defn(name="CloseWatchChain", sandboxed=False)
class Chain:
    """Continues as new while ``hops`` is above 0, then waits for ``finish``."""

    def __init__(self) -> None:
        self._next = False

    @workflow.signal
    def next(self) -> None:
        self._next = True

    @workflow.run
    async def run(self, hops: int) -> str:
        await workflow.wait_condition(lambda: self._next)
        if hops > 0:
            workflow.continue_as_new(hops - 1)
        return "done"


@pytest.fixture
async def server() -> AsyncIterator[DevServer]:
    dev = await asyncio.to_thread(start_dev_server)
    try:
        yield dev
    finally:
        dev.stop()


async def _started(client: Client, run: RunHandle, queue: str, hops: int) -> None:
    await client.start_workflow(Chain.run, hops, id=run.workflow_id, task_queue=queue)


async def _still_waiting(task: asyncio.Future[None]) -> bool:
    done, _ = await asyncio.wait({task}, timeout=1.0)
    return not done


async def test_it_returns_at_the_close_of_the_chain_not_at_its_continue_as_new(
    server: DevServer,
):
    client = await connect(server.address)
    queue = f"close-watch-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[Chain]):
        run = RunHandle(client, 7001)
        await _started(client, run, queue, hops=1)
        first = (await run.workflow.describe()).run_id
        closed = asyncio.ensure_future(run.wait_closed())
        # Its long poll on the first run first (were it late, it would poll the second
        # run and the test would only be weaker, never fail for it).
        await asyncio.sleep(0.5)
        await run.workflow.signal(Chain.next)

        async def next_run_up() -> bool:
            return (await run.workflow.describe()).run_id != first

        await eventually(next_run_up, timeout=30, what="the chain's next run")
        assert await _still_waiting(closed)
        await run.workflow.signal(Chain.next)
        await asyncio.wait_for(closed, 30)

        ended = RunHandle(client, 7002)
        await _started(client, ended, queue, hops=0)
        closed = asyncio.ensure_future(ended.wait_closed())
        assert await _still_waiting(closed)
        await ended.workflow.terminate("ended elsewhere")
        await asyncio.wait_for(closed, 30)


async def test_a_server_that_cannot_be_asked_is_an_rpc_error(server: DevServer):
    client = await connect(server.address)
    run = RunHandle(client, 7003)
    server.stop()
    with pytest.raises(RPCError):
        await asyncio.wait_for(run.wait_closed(), 60)
