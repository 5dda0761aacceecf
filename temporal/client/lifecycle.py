"""The run itself as a client sees it: attach or start ``mvp-run-<run_id>``, read its
state, wait until it is prompt-ready or closed, and shut it down. The base of
:class:`~temporal.client.RunHandle`: it holds everything the handle keeps."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Self, cast

from temporalio.client import (
    Client,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.service import RPCError, RPCStatusCode

from mvp_core import names
from mvp_core.models import (
    DatastreamAddress,
    PromptHost,
    RequestShutdown,
    RunOutcome,
    RunPhase,
    RunRequest,
    ShutdownReason,
)
from mvp_core.names import QUERY_TIMEOUT
from mvp_core.run_signals import signal_name
from mvp_core.run_state import RunState
from mvp_core.web_ui import run_details, run_summary
from temporal.client.admissions import Admissions
from temporal.client.endboard import EndBoard
from temporal.client.errors import PromptNotFound, PromptUnavailable, RunClosed, RunNotOpen
from temporal.client.fetches import share_fetches
from temporal.client.updates import drop
from temporal.text_stream import TextStreamTarget, host_secret
from workflows.run import RunWorkflow

# "0": this process's run handles start no prompt early on the head node (DECISIONS 103).
EARLY_START_ENV = "MVP_EARLY_START"
QUERY_FAILED = (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError)


class RunLifecycle:
    """Run ``mvp-run-<run_id>``: its workflow handle, state, readiness and shutdown."""

    def __init__(
        self,
        client: Client,
        run_id: int,
        *,
        direct_text: bool = True,
        quick_refusals: bool = False,
        early_start: bool | None = None,
    ) -> None:
        """``direct_text``: read prompts' text from the run's head node: with the
        deployment's edge secret where this host holds it (DECISIONS 63), else each prompt
        this handle admits with its own random key (DECISIONS 80); False: from Temporal
        only. ``quick_refusals``: an admission the server refuses past its limits fails
        within a second instead of after the SDK's retries (temporal/client/refusals.py).
        ``early_start``: hand the head node a prompt with its text stream's request, for
        it to start while the run admits it (DECISIONS 103); None: unless this process's
        ``MVP_EARLY_START`` is ``0``."""
        if early_start is None:
            early_start = os.environ.get(EARLY_START_ENV, "1") != "0"
        self._early_start = early_start
        self.client = client
        self._quick_refusals = quick_refusals
        self.run_id = run_id
        self.workflow_id = names.run_workflow_id(run_id)
        self._workflow: WorkflowHandle[Any, Any] | None = None
        self._cancelled: set[int] = set()  # request ids this handle has cancelled
        self._background: set[asyncio.Future[Any]] = set()
        self._direct_text = direct_text
        self._secret = host_secret() if direct_text else None
        self._target: TextStreamTarget | None = None  # the head node's text stream
        self._told_why = False  # a direct stream that could not be read: said once
        self._looking: asyncio.Future[RunState | None] | None = None  # a shared snapshot
        self._prompt_host: PromptHost | None = None  # where the run serves prompts
        self.direct_streams = 0  # prompts whose text came from the head node to the end
        self._admissions: Admissions | None = None  # admissions in flight (made in use)
        self._end_board: EndBoard | None = None  # prompts' ends, asked together (made in use)
        self._ends_in_one = True  # False: the run's worker has no prompt_ends query
        # Prompts whose end came with their text (DECISIONS 95), by prompt id: the run
        # counts them a workflow task or two later, which an admission refused as a full
        # queue or a request id in use waits for (PromptCalls._admit).
        self._ends_to_count: dict[str, int] = {}

    @property
    def holds_secret(self) -> bool:
        """This handle reads text with the deployment's edge secret (DECISIONS 63), not
        with a key per prompt (DECISIONS 80)."""
        return self._secret is not None

    @property
    def workflow(self) -> WorkflowHandle[Any, Any]:
        """The run's workflow handle (made on first use)."""
        if self._workflow is None:
            self._workflow = self.client.get_workflow_handle(self.workflow_id)
        return self._workflow

    @classmethod
    async def start(cls, client: Client, run_id: int, request: RunRequest) -> Self:
        """Start run ``run_id`` as the docs say, with the short workflow task timeout that
        lets another worker take over a lost task quickly. Raises the SDK's
        ``WorkflowAlreadyStartedError`` when the run exists, ``RPCError`` otherwise."""
        run = cls(client, run_id)
        run._workflow = await client.start_workflow(
            names.RUN_WORKFLOW,
            request,
            id=run.workflow_id,
            task_queue=names.ORCHESTRATOR_TASK_QUEUE,
            task_timeout=timedelta(seconds=names.WORKFLOW_TASK_TIMEOUT_S),
            # What the Web UI lists for the run (its live details come from the run itself).
            static_summary=run_summary(run_id, request),
            static_details=run_details(run_id, request),
        )
        return run

    async def describe(self) -> WorkflowExecutionDescription:
        return await self.workflow.describe()

    async def request(self) -> RunRequest | None:
        """The run's RunRequest, from its current execution's input (a RunRequest, or the
        ``request`` of the RunCarry a continued run starts with); None when that input is
        not one. The SDK's RPCError where the history cannot be read."""
        handle = self.client.get_workflow_handle(self.workflow_id)
        async for event in handle.fetch_history_events(page_size=1):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            (start,) = await self.client.data_converter.decode(payloads, [dict[str, Any]])
            raw = start.get("request", start) if isinstance(start, dict) else None
            try:
                return RunRequest.model_validate(raw)
            except ValueError:
                return None
        return None

    async def check_open(self, address: str) -> None:
        """Raise RunNotOpen unless the run exists and is running."""
        try:
            desc = await self.workflow.describe()
        except RPCError as err:
            if err.status is RPCStatusCode.NOT_FOUND:
                raise RunNotOpen(f"no run {self.workflow_id} on {address}") from None
            raise RunNotOpen(
                f"cannot describe run {self.workflow_id} on {address}: {err}"
            ) from None
        if desc.status is not WorkflowExecutionStatus.RUNNING:
            status = desc.status.name.lower() if desc.status else "closed"
            raise RunNotOpen(f"run {self.workflow_id} has ended ({status})")

    async def wait_closed(self) -> None:
        """Returns once the run has closed, however it ended (through its continue-as-new
        chain): one long poll of its close event that the server holds (~20 s a round), not
        a describe a second. RPCError when the server cannot be asked. Each call starts at
        the run's latest execution (a handle pinned to the first would walk the chain from
        a run that may be past retention after an outage)."""
        try:
            await self.client.get_workflow_handle(self.workflow_id).result()
        except RPCError:
            raise
        except Exception:  # failed, terminated, cancelled, timed out: closed all the same
            return

    async def snapshot(self, *, rpc_timeout: timedelta = QUERY_TIMEOUT) -> RunState:
        """The run's state (query ``snapshot``); the SDK's query or RPC error when the run
        cannot answer."""
        state: RunState = await self.workflow.query(RunWorkflow.snapshot, rpc_timeout=rpc_timeout)
        return state

    async def _ask_run(self, query: str, arg: Any, result_type: Any, about: str) -> Any:
        """One of the run's queries about its prompts. PromptNotFound: no such run;
        PromptUnavailable: the run cannot answer now (no worker has it, a server that
        refused or could not be reached)."""
        try:
            return await self.workflow.query(
                query, arg, result_type=result_type, rpc_timeout=QUERY_TIMEOUT
            )
        except RPCError as err:
            if err.status is RPCStatusCode.NOT_FOUND:
                raise PromptNotFound(f"run {self.run_id} does not exist") from None
            raise PromptUnavailable(
                f"run {self.run_id} cannot answer {query} for {about} now: {err}"
            ) from None
        except (WorkflowQueryFailedError, WorkflowQueryRejectedError) as err:
            raise PromptUnavailable(
                f"run {self.run_id} cannot answer {query} for {about} now: {err}"
            ) from None

    async def try_snapshot(self, *, rpc_timeout: timedelta = QUERY_TIMEOUT) -> RunState | None:
        """The run's state, or None when it cannot answer now (no worker has it yet, a
        worker restarting, a server unreachable)."""
        try:
            return await self.snapshot(rpc_timeout=rpc_timeout)
        except QUERY_FAILED:
            return None

    async def fetches(self) -> dict[int, tuple[int, int]]:
        """The model shares the run's nodes are fetching now, by node id: (bytes held,
        bytes in all), from its pending start activities (DECISIONS 79); empty when none
        is. The SDK's RPCError where the server cannot be asked."""
        return await share_fetches(self.client, self.workflow_id)

    async def shared_snapshot(self) -> RunState | None:
        """``try_snapshot``, shared by every caller while one is in flight: a burst of
        streams that each need the run's state (its head node, where it serves prompts)
        makes one query, not one each (a server buffers one query per busy workflow,
        DECISIONS 78)."""
        if self._looking is None or self._looking.done():
            self._looking = asyncio.ensure_future(self.try_snapshot())
        return await asyncio.shield(self._looking)

    async def datastream(
        self, *, wait_s: float = 0.0, poll_s: float = 0.2
    ) -> DatastreamAddress | None:
        """Where the run's datastream is served and archived (DECISIONS 58), as its
        datastream activity last told the run; None when it has not (yet: ``wait_s``
        seconds are waited for it). A closed run still tells where its archive is."""
        deadline = time.monotonic() + max(0.0, wait_s)
        while True:
            state = await self.try_snapshot()
            if state is not None and state.datastream is not None:
                return state.datastream
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(poll_s)

    async def wait_prompt_ready(
        self, *, poll_s: float = 0.2, check: Callable[[], None] | None = None
    ) -> RunState:
        """Return the run's state once it is prompt-ready. Raises RunClosed when the run
        closes first; ``check`` is called on every poll and may raise to stop waiting
        (e.g. when a worker this process started has exited)."""
        closed = asyncio.ensure_future(self.workflow.result())
        try:
            while not closed.done():
                if check is not None:
                    check()
                state = await self.try_snapshot()
                if state is not None and state.phase is RunPhase.PROMPT_READY:
                    return state
                await asyncio.wait([closed], timeout=poll_s)
            raise RunClosed(self.workflow_id, closed.exception())
        finally:
            drop(closed)

    async def result(self) -> RunOutcome:
        """Wait for the run to close; its outcome, or the SDK's WorkflowFailureError for a
        rejected or faulted run."""
        raw = await self.workflow.result()
        return RunOutcome.model_validate(raw)

    async def _settle_ends(self) -> None:
        """Before a stop: the ends this handle took from its prompts' text streams are
        counted by the run first (PromptEnds; DECISIONS 95)."""

    async def request_shutdown(self, reason: ShutdownReason) -> bool:
        """Ask the run to shut down (signal ``request_shutdown``) without waiting; False
        when the run is closed already. Other RPC errors are raised."""
        await self._settle_ends()
        try:
            request = RequestShutdown(run_id=self.run_id, reason=reason)
            await self.workflow.signal(signal_name(request), request)
        except RPCError as err:
            if err.status is RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def shutdown_and_wait(self, reason: ShutdownReason) -> RunOutcome:
        """Shut the run down and return once it is torn down (Update
        ``request_shutdown_and_wait``); the SDK's Update or RPC errors otherwise."""
        await self._settle_ends()
        outcome = await self.workflow.execute_update(
            RunWorkflow.request_shutdown_and_wait,
            RequestShutdown(run_id=self.run_id, reason=reason),
        )
        return cast(RunOutcome, outcome)  # the SDK types an async handler's result loosely

    async def terminate(self, reason: str) -> None:
        await self.workflow.terminate(reason=reason)
