"""An Update the server aborted as WorkflowNotReady (never accepted) is sent again; any
other RPC error is the caller's at once."""

from __future__ import annotations

import pytest
from google.protobuf import any_pb2
from temporalio.api.common.v1 import GrpcStatus
from temporalio.api.errordetails.v1 import WorkflowNotReadyFailure
from temporalio.service import RPCError, RPCStatusCode

from temporal.client import updates as run_client


def _error(not_ready: bool) -> RPCError:
    status = GrpcStatus(code=9, message="Unable to perform workflow execution update")
    if not_ready:
        detail = any_pb2.Any()
        detail.Pack(WorkflowNotReadyFailure())
        status.details.append(detail)
    return RPCError(status.message, RPCStatusCode.FAILED_PRECONDITION, status.SerializeToString())


async def test_not_ready_is_resent_until_it_goes_through(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(run_client, "NOT_READY_PAUSE_S", 0.0)
    calls = 0

    async def send() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise _error(not_ready=True)
        return "admitted"

    assert await run_client.resent_when_not_ready(send) == "admitted"
    assert calls == 3


async def test_other_rpc_errors_and_a_lasting_not_ready_are_raised(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(run_client, "NOT_READY_PAUSE_S", 0.0)
    calls = 0

    async def other() -> str:
        nonlocal calls
        calls += 1
        raise _error(not_ready=False)

    with pytest.raises(RPCError):
        await run_client.resent_when_not_ready(other)
    assert calls == 1

    async def never() -> str:
        raise _error(not_ready=True)

    with pytest.raises(RPCError):
        await run_client.resent_when_not_ready(never)
