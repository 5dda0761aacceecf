"""A server's refusal of an Update past its limit on Updates in flight (RESOURCE_EXHAUSTED)
reaches a quick-refusal client's caller while the SDK's default retries would still be
waiting it out (temporal/client/refusals.py; the gateway's 429 within a second, issue 37).

A real dev server allowing one Update in flight per workflow, and a workflow whose
Update holds until released: a second Update through the quick client fails with
RESOURCE_EXHAUSTED, while the same through the plain client is still being retried."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowUpdateStage
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker

from temporal.client.refusals import QUICK_RETRY, quick_client
from temporal.devserver import DevServer, start_dev_server


@workflow.defn(sandboxed=False)
class Held:
    def __init__(self) -> None:
        self.released = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self.released)

    @workflow.update
    async def hold(self) -> str:
        await workflow.wait_condition(lambda: self.released)
        return "held"

    @workflow.signal
    def release(self) -> None:
        self.released = True


@pytest.fixture(scope="module")
def server() -> Iterator[DevServer]:
    srv = start_dev_server(None, dynamic_config={"history.maxInFlightUpdates": "1"})
    try:
        yield srv
    finally:
        srv.stop()


async def test_a_refused_update_fails_at_once_on_the_quick_client_only(server: DevServer):
    client = await Client.connect(server.address)
    queue = f"quick-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[Held]):
        handle = await client.start_workflow(Held.run, id=f"held-{queue}", task_queue=queue)
        # Accepted and not completed: the one Update the server lets be in flight.
        first = await handle.start_update(Held.hold, wait_for_stage=WorkflowUpdateStage.ACCEPTED)
        quick = await quick_client(client)
        assert await quick_client(client) is quick  # one per client
        assert quick.service_client.config.retry_config == QUICK_RETRY
        plain = asyncio.ensure_future(handle.execute_update(Held.hold))
        with pytest.raises(RPCError) as refused:
            await quick.get_workflow_handle(handle.id).execute_update(Held.hold)
        assert refused.value.status is RPCStatusCode.RESOURCE_EXHAUSTED
        # The plain client's call is still in the SDK's retries of the same refusal.
        assert not plain.done()
        await handle.signal(Held.release)
        assert await first.result() == "held"
        # Released: the retried call is accepted, or finds the workflow completed; it
        # ends either way (not left behind).
        with contextlib.suppress(Exception):
            await asyncio.wait_for(plain, 30)
        assert plain.done()
