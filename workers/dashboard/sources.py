"""What the dashboard reads of Temporal: a run's ``describe`` and ``snapshot``, the open
runs (visibility), a finished prompt's history (its figures), the node shares being
fetched. ``RunSource`` is the protocol (a script in tests); ``TemporalSource`` reads with
a client (the gateway's, the host's)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.service import RPCError, RPCStatusCode

from mvp_core import names
from mvp_core.models import PromptOutcome
from mvp_core.run_state import RunState
from temporal.client import QUERY_TIMEOUT, PromptUnavailable, RunHandle
from temporal.client.fetches import share_fetches
from workers.dashboard.view import PromptFigures, RunStatus, figures, served_figures

log = logging.getLogger("mvp.dashboard")

# The signal that carries a workflow stream's published items (temporalio.contrib
# .workflow_streams): a prompt's first one holds its first text (sent at once).
STREAM_PUBLISH_SIGNAL = "__temporal_workflow_stream_publish"

_STATUS: dict[WorkflowExecutionStatus, RunStatus] = {
    WorkflowExecutionStatus.RUNNING: "running",
    WorkflowExecutionStatus.COMPLETED: "completed",
    WorkflowExecutionStatus.FAILED: "failed",
    WorkflowExecutionStatus.CANCELED: "canceled",
    WorkflowExecutionStatus.TERMINATED: "terminated",
    WorkflowExecutionStatus.CONTINUED_AS_NEW: "continued_as_new",
    WorkflowExecutionStatus.TIMED_OUT: "timed_out",
}


class SourceError(Exception):
    """A read that did not answer; the message says which and why, in a few words."""


class RunSource(Protocol):
    """The reads the dashboard makes (Temporal in the gateway, a script in tests)."""

    async def describe(self, workflow_id: str) -> tuple[RunStatus, str | None]:
        """The run's status and its execution's id (``not_found``: no such run)."""
        ...

    async def snapshot(self, workflow_id: str) -> RunState: ...

    async def running_runs(self, limit: int) -> list[str]:
        """Workflow ids of open runs, newest first."""
        ...

    async def prompt_figures(self, workflow_id: str) -> PromptFigures: ...

    async def fetches(self, workflow_id: str) -> dict[int, tuple[int, int]]:
        """The node shares being fetched now, by node: (bytes held, bytes in all), from
        the start activities' heartbeats (activities/model_share.py)."""
        ...

    async def served_figures(
        self, run_workflow_id: str, request_id: int, key: str
    ) -> PromptFigures:
        """A run-hosted prompt's figures (DECISIONS 66), from what its run kept of it."""
        ...


class TemporalSource:
    """Reads of Temporal only: describe, query, visibility list and history."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def describe(self, workflow_id: str) -> tuple[RunStatus, str | None]:
        try:
            desc = await self.client.get_workflow_handle(workflow_id).describe(
                rpc_timeout=QUERY_TIMEOUT
            )
        except RPCError as err:
            if err.status is RPCStatusCode.NOT_FOUND:
                return "not_found", None
            raise SourceError(f"describe failed: {err.message}") from None
        status = _STATUS.get(desc.status, "running") if desc.status else "running"
        return status, desc.run_id

    async def fetches(self, workflow_id: str) -> dict[int, tuple[int, int]]:
        try:
            return await share_fetches(self.client, workflow_id)
        except RPCError as err:
            raise SourceError(f"describe failed: {err.message}") from None

    async def snapshot(self, workflow_id: str) -> RunState:
        try:
            state: RunState = await self.client.get_workflow_handle(workflow_id).query(
                names.QUERY_SNAPSHOT, result_type=RunState, rpc_timeout=QUERY_TIMEOUT
            )
        except RPCError as err:
            raise SourceError(f"snapshot query failed: {err.message}") from None
        except (WorkflowQueryFailedError, WorkflowQueryRejectedError) as err:
            raise SourceError(f"snapshot query failed: {err}") from None
        return state

    async def running_runs(self, limit: int) -> list[str]:
        query = f"WorkflowType = '{names.RUN_WORKFLOW}' AND ExecutionStatus = 'Running'"
        try:
            return [
                wf.id
                async for wf in self.client.list_workflows(
                    query, limit=limit, rpc_timeout=QUERY_TIMEOUT
                )
            ]
        except RPCError as err:
            raise SourceError(f"visibility list failed: {err.message}") from None

    async def prompt_figures(self, workflow_id: str) -> PromptFigures:
        try:
            history = await self.client.get_workflow_handle(workflow_id).fetch_history(
                rpc_timeout=QUERY_TIMEOUT
            )
        except RPCError as err:
            raise SourceError(f"history of {workflow_id}: {err.message}") from None
        times = history_times(history.events)
        outcome: PromptOutcome | None = None
        if times.result is not None:
            try:
                decoded = await self.client.data_converter.decode(times.result, [PromptOutcome])
                outcome = decoded[0]
            except Exception as err:  # a payload this gateway cannot decode (a codec)
                log.warning("result of %s: %s", workflow_id, type(err).__name__)
        return figures(
            outcome,
            started_ms=times.started_ms,
            scheduled_ms=times.scheduled_ms,
            first_text_ms=times.first_text_ms,
        )

    async def served_figures(
        self, run_workflow_id: str, request_id: int, key: str
    ) -> PromptFigures:
        run_id = names.run_id_from_workflow_id(run_workflow_id)
        if run_id is None:
            raise SourceError(f"prompt {key}: {run_workflow_id} is not a run's workflow id")
        try:
            served = await RunHandle(self.client, run_id, direct_text=False).served(request_id)
        except PromptUnavailable as err:
            raise SourceError(f"prompt {key}: {err}") from None
        if served is None or served.workflow_id != key:
            raise SourceError(f"prompt {key}: no longer kept by its run")
        return served_figures(served)


class HistoryTimes:
    """What a prompt's history tells the dashboard (event times in epoch ms)."""

    def __init__(self) -> None:
        self.started_ms: int | None = None
        self.scheduled_ms: int | None = None
        self.first_text_ms: int | None = None
        self.result: list[Any] | None = None  # the completion's payloads, undecoded


def _ms(stamp: Timestamp) -> int:
    return stamp.seconds * 1000 + stamp.nanos // 1_000_000


def history_times(events: Iterable[HistoryEvent]) -> HistoryTimes:
    """The start, the first activity scheduled, the first stream publish and the result
    of a prompt workflow's history (payloads are not read, only the result kept)."""
    out = HistoryTimes()
    for event in events:
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            out.started_ms = _ms(event.event_time)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED and out.scheduled_ms is None:
            out.scheduled_ms = _ms(event.event_time)
        elif (
            kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
            and out.first_text_ms is None
            and event.workflow_execution_signaled_event_attributes.signal_name
            == STREAM_PUBLISH_SIGNAL
        ):
            out.first_text_ms = _ms(event.event_time)
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
            out.result = list(event.workflow_execution_completed_event_attributes.result.payloads)
    return out
