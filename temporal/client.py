"""The typed client of a run: one :class:`RunHandle` for everything a host, the gateway,
the demo or ``mvp-chat`` asks of run ``mvp-run-<run_id>``.

    run = await RunHandle.start(client, 7, request)     # or RunHandle(client, 7) to attach
    await run.wait_prompt_ready()
    async with contextlib.aclosing(run.stream(SubmitPrompt(...))) as events:
        async for event in events:
            if isinstance(event, TextDelta): print(event.text, end="", flush=True)
            else: ...  # Done or Fault, always last, exactly once
    outcome = await run.shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)

The prompt is admitted by the run's ``submit_prompt`` Update (its validator rejects a
full queue, a duplicate id, or a run that is not prompt-ready, raising ``PromptRejected``);
its text deltas come from the prompt's own workflow stream, which any client can
subscribe to and re-attach to; the terminal event is the Update's result. A stream owns
its prompt: left before its terminal event (a ``break``, an error, a cancellation, or the
iterator dropped), it cancels the prompt, so that the run's active slot is free for the
next one (DECISIONS 55).

Updates and the query are called by method reference (``RunWorkflow.submit_prompt``);
the run's two client signals (``request_shutdown``, ``cancel_prompt``) are routed by the
run's dynamic signal handler, so they go by their names in ``mvp_core.names``, from here
only. The module-level functions below are the same calls for one-off use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, cast

from pydantic import TypeAdapter
from temporalio.client import (
    Client,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
    WorkflowUpdateFailedError,
    WorkflowUpdateHandle,
    WorkflowUpdateRPCTimeoutOrCancelledError,
    WorkflowUpdateStage,
)
from temporalio.contrib.workflow_streams import WorkflowStreamClient
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from mvp_core import names
from mvp_core.models import (
    CancelPrompt,
    DatastreamAddress,
    Done,
    Fault,
    PromptEvent,
    PromptHost,
    PromptOutcome,
    RequestShutdown,
    RunOutcome,
    RunPhase,
    RunRequest,
    ServedPrompt,
    ShutdownReason,
    SubmitPrompt,
    TextDelta,
)
from mvp_core.run_state import RunState
from mvp_core.web_ui import run_details, run_summary
from temporal.text_stream import (
    TextStreamError,
    TextStreamRefused,
    TextStreamTarget,
    host_secret,
    read_text,
    target_of,
)
from workflows.run import RunWorkflow

T = TypeVar("T")
_EVENT: TypeAdapter[TextDelta | Done | Fault] = TypeAdapter(PromptEvent)

QUERY_TIMEOUT = timedelta(seconds=5)  # one snapshot query (a run no worker has answers late)
CANCEL_TIMEOUT_S = 5.0  # a cancel_prompt signal that takes longer is given up
ADMIT_WAIT_S = 30.0  # a stream cancelled while its admission is in flight waits this long
# After an Update is accepted: is its outcome known already (a validator's rejection comes
# back with the acceptance)? A result call this short answers from what the handle knows,
# and otherwise gives up at once; it never waits for the prompt.
_OUTCOME_PEEK = timedelta(milliseconds=1)
QUERY_FAILED = (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError)
# An Update the server aborted before it was accepted, because the workflow task it rode
# on failed (e.g. the server refused a continue-as-new completion that raced with it):
# ``WorkflowNotReady``. Nothing of the Update happened, so it is sent again, with the same
# id, this many times at most, after a growing pause.
NOT_READY_RETRIES = 20
NOT_READY_PAUSE_S = 0.05

PromptEvents = AsyncGenerator[TextDelta | Done | Fault, None]
FIRST = asyncio.FIRST_COMPLETED
# A prompt's result is in while its text stream says nothing: what the head node still
# sends within this long is read (its end line normally comes before the result).
DIRECT_GRACE_S = 2.0
# A run-hosted prompt's direct stream that broke (its head node lost, DECISIONS 68) is
# read again from the replacement head, at most this many times, while the prompt runs.
DIRECT_RESUMES = 3
NEW_HEAD_POLL_S = 0.3
log = logging.getLogger("mvp.client")


def _not_ready(err: RPCError) -> bool:
    """The server's WorkflowNotReady answer to an Update (never accepted, safe to resend)."""
    try:
        details = err.grpc_status.details
    except Exception:  # an undecodable status is not that answer
        return False
    return any(d.type_url.endswith("WorkflowNotReadyFailure") for d in details)


async def _resent_when_not_ready(send: Callable[[], Awaitable[T]]) -> T:
    """``send()``, again after a pause when the server answers WorkflowNotReady."""
    for attempt in range(NOT_READY_RETRIES):
        try:
            return await send()
        except RPCError as err:
            if not _not_ready(err) or attempt == NOT_READY_RETRIES - 1:
                raise
        await asyncio.sleep(NOT_READY_PAUSE_S * (attempt + 1))
    raise AssertionError("unreachable")


class PromptRejected(Exception):
    """The run refused the prompt; ``kind`` is the typed rejection (DECISIONS 9)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class PromptNotFound(LookupError):
    """No prompt of that request id was ever admitted by the run."""


class PromptUnavailable(Exception):
    """The run could not say where a prompt is now (no worker has it): try again."""


class RunNotOpen(Exception):
    """The run does not exist, cannot be described, or has ended (the message says which)."""


class RunClosed(Exception):
    """The run closed while the caller waited for it to become prompt-ready. ``error`` is
    how its result failed (a ``WorkflowFailureError`` for a rejected or faulted run), None
    when it closed without a failure."""

    def __init__(self, workflow_id: str, error: BaseException | None) -> None:
        super().__init__(
            f"run {workflow_id} closed before it was prompt-ready"
            + (f": {error}" if error is not None else "")
        )
        self.error = error


def _drop(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` if it still runs, and never leave its end unread: a cancelled
    Update result ends with the SDK's own error, which asyncio would report as "never
    retrieved"."""
    if not task.done():
        task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _rejection(err: WorkflowUpdateFailedError) -> PromptRejected:
    cause = err.cause
    if isinstance(cause, ApplicationError):
        return PromptRejected(cause.type or "Rejected", cause.message)
    return PromptRejected("Rejected", str(cause or err))


class RunHandle:
    """Run ``mvp-run-<run_id>`` as a client sees it. ``RunHandle(client, run_id)`` attaches
    to a run that exists (or will); :meth:`start` starts one. Cheap: it holds the client,
    the workflow handle and the cancels it has sent."""

    def __init__(self, client: Client, run_id: int, *, direct_text: bool = True) -> None:
        """``direct_text``: read prompts' text from the run's head node where this host
        holds the deployment's edge secret (DECISIONS 63); False: from Temporal only."""
        self.client = client
        self.run_id = run_id
        self.workflow_id = names.run_workflow_id(run_id)
        self._workflow: WorkflowHandle[Any, Any] | None = None
        self._cancelled: set[int] = set()  # request ids this handle has cancelled
        self._background: set[asyncio.Future[Any]] = set()
        self._secret = host_secret() if direct_text else None
        self._target: TextStreamTarget | None = None  # the head node's text stream
        self._prompt_host: PromptHost | None = None  # where the run serves prompts
        self.direct_streams = 0  # prompts whose text came from the head node to the end

    @property
    def workflow(self) -> WorkflowHandle[Any, Any]:
        """The run's workflow handle (made on first use)."""
        if self._workflow is None:
            self._workflow = self.client.get_workflow_handle(self.workflow_id)
        return self._workflow

    # ------------------------------------------------------------------ the run
    @classmethod
    async def start(cls, client: Client, run_id: int, request: RunRequest) -> RunHandle:
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

    async def try_snapshot(self, *, rpc_timeout: timedelta = QUERY_TIMEOUT) -> RunState | None:
        """The run's state, or None when it cannot answer now (no worker has it yet, a
        worker restarting, a server unreachable)."""
        try:
            return await self.snapshot(rpc_timeout=rpc_timeout)
        except QUERY_FAILED:
            return None

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
            _drop(closed)

    async def result(self) -> RunOutcome:
        """Wait for the run to close; its outcome, or the SDK's WorkflowFailureError for a
        rejected or faulted run."""
        raw = await self.workflow.result()
        return RunOutcome.model_validate(raw)

    async def request_shutdown(self, reason: ShutdownReason) -> bool:
        """Ask the run to shut down (signal ``request_shutdown``) without waiting; False
        when the run is closed already. Other RPC errors are raised."""
        try:
            await self.workflow.signal(
                names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=self.run_id, reason=reason)
            )
        except RPCError as err:
            if err.status is RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def shutdown_and_wait(self, reason: ShutdownReason) -> RunOutcome:
        """Shut the run down and return once it is torn down (Update
        ``request_shutdown_and_wait``); the SDK's Update or RPC errors otherwise."""
        outcome = await self.workflow.execute_update(
            RunWorkflow.request_shutdown_and_wait,
            RequestShutdown(run_id=self.run_id, reason=reason),
        )
        return cast(RunOutcome, outcome)  # the SDK types an async handler's result loosely

    async def terminate(self, reason: str) -> None:
        await self.workflow.terminate(reason=reason)

    # ------------------------------------------------------------------ prompts
    async def _admit(self, prompt: SubmitPrompt, update_id: str) -> WorkflowUpdateHandle[Any]:
        """Start the ``submit_prompt`` Update and return its handle once the run admitted
        the prompt; a refusal raises PromptRejected.

        A validator's rejection comes back as an Update already completed with a failure
        (the server answers the ACCEPTED wait with the outcome): it is read at once here,
        so the caller never holds a handle for a prompt that was not admitted."""
        try:
            # (Any: the SDK types an async handler's result as its coroutine)
            update: WorkflowUpdateHandle[Any] = await _resent_when_not_ready(
                lambda: self.workflow.start_update(
                    RunWorkflow.submit_prompt,
                    prompt,
                    id=update_id,
                    wait_for_stage=WorkflowUpdateStage.ACCEPTED,
                )
            )
            # Known outcome: a rejection raises here (a prompt already done returns);
            # none known: the peek gives up at once, and the prompt is admitted.
            with contextlib.suppress(WorkflowUpdateRPCTimeoutOrCancelledError, RPCError):
                await update.result(rpc_timeout=_OUTCOME_PEEK)
        except WorkflowUpdateFailedError as err:
            raise _rejection(err) from None
        self._cancelled.discard(prompt.request_id)  # a new prompt of this id
        return update

    async def start_prompt(self, prompt: SubmitPrompt) -> WorkflowUpdateHandle[Any]:
        """Submit and return once the run has admitted the prompt (FIFO from here on);
        raises PromptRejected when the run refuses it. The handle's ``result()`` is the
        prompt's Done or Fault."""
        return await self._admit(prompt, uuid.uuid4().hex)

    async def submit(self, prompt: SubmitPrompt) -> Done | Fault:
        """Submit and wait for the terminal event, without streaming."""
        try:
            update_id = uuid.uuid4().hex  # one id for every resend
            result = await _resent_when_not_ready(
                lambda: self.workflow.execute_update(
                    RunWorkflow.submit_prompt, prompt, id=update_id
                )
            )
        except WorkflowUpdateFailedError as err:
            raise _rejection(err) from None
        self._cancelled.discard(prompt.request_id)
        return cast(Done | Fault, result)

    async def cancel_prompt(self, request_id: int) -> None:
        """Ask the run to end prompt ``request_id`` (signal ``cancel_prompt``; the prompt
        ends with a Fault ``cancelled``); bounded, and quiet when the run cannot be reached.
        A prompt this handle has cancelled already is not cancelled twice."""
        if request_id in self._cancelled:
            return
        self._cancelled.add(request_id)
        with contextlib.suppress(RPCError, TimeoutError):
            async with asyncio.timeout(CANCEL_TIMEOUT_S):
                await self.workflow.signal(
                    names.SIGNAL_CANCEL_PROMPT, CancelPrompt(request_id=request_id)
                )

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _cancel_when_admitted(self, admit: asyncio.Future[Any], request_id: int) -> None:
        """A stream cancelled while its admission was in flight: the run may admit the
        prompt all the same; if it does, cancel it."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(ADMIT_WAIT_S):
                await asyncio.shield(admit)
        if admit.done() and not admit.cancelled() and admit.exception() is None:
            await self.cancel_prompt(request_id)
        else:
            _drop(admit)

    async def stream(
        self,
        prompt: SubmitPrompt,
        *,
        poll_cooldown_ms: int = 20,
        on_admitted: Callable[[], None] | None = None,
    ) -> PromptEvents:
        """Yield the prompt's TextDelta events as they arrive, then its one terminal event.
        ``on_admitted`` is called once the run has admitted the prompt (its place in the
        run's FIFO is fixed from then on). Leaving the stream before its terminal event
        cancels the prompt (``cancel_prompt``): the run's active slot is not held by a
        prompt nobody reads."""
        update_id = uuid.uuid4().hex
        admit = asyncio.ensure_future(self._admit(prompt, update_id))
        try:
            update = await asyncio.shield(admit)
        except asyncio.CancelledError:
            self._spawn(self._cancel_when_admitted(admit, prompt.request_id))
            raise
        if on_admitted is not None:
            on_admitted()
        child_id = names.prompt_workflow_id(self.run_id, prompt.request_id, update_id)
        result_task: asyncio.Future[Any] = asyncio.ensure_future(update.result())
        terminal: Done | Fault | None = None
        try:
            async for event in self._events(child_id, result_task, poll_cooldown_ms):
                if isinstance(event, TextDelta):
                    yield event
                else:
                    terminal = event
                    break
            result = cast(Done | Fault, await result_task)
            terminal = terminal if terminal is not None else result
            yield terminal
        finally:
            ended = terminal is not None or (
                result_task.done() and not result_task.cancelled() and not result_task.exception()
            )
            if not ended:
                # Abandoned (a break, an error, a cancellation, the iterator dropped):
                # the run ends the prompt now, whatever happens to this task.
                cancel = self._spawn(self.cancel_prompt(prompt.request_id))
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.shield(cancel)
            _drop(result_task)

    async def _events(
        self, child_id: str, result_task: asyncio.Future[Any], poll_cooldown_ms: int, start: int = 0
    ) -> PromptEvents:
        """The prompt's text deltas (from the head node where this host can read it
        directly, else from the prompt workflow's stream), then its terminal event: the
        stream's, or else the result's, after any text the deltas missed (a Done holds
        the whole text). ``start``: the deltas already seen of the workflow's stream."""
        sent: list[str] = []
        tokens = 0  # ... and the generated tokens they held
        direct_end = False
        target = await self._text_target() if not result_task.done() else None
        resumes = 0
        while target is not None:
            skip = len("".join(sent))  # a new head's stream starts from the first text
            try:
                async for got in self._direct(target, child_id, result_task):
                    delta, skip = _cut(got, skip)
                    if delta is None:
                        continue
                    sent.append(delta.text)
                    tokens += delta.tokens or 0
                    yield delta
                direct_end = True
                self.direct_streams += 1
            except TextStreamRefused as err:
                log.info("%s: text from Temporal from now on: %s", self.workflow_id, err)
                self._secret = None  # this host's secret is not the run's: never again
            except TextStreamError as err:
                self._target = None  # asked again next time (the head may have moved)
                if resumes < DIRECT_RESUMES and await self._hosts_prompts():
                    # A run-hosted prompt has no Temporal stream: its text goes on from
                    # the replacement head, should its head be replaced (DECISIONS 68).
                    resumes += 1
                    target = await self._new_head(target, result_task)
                    if target is not None:
                        log.info("%s: text from the new head: %s", child_id, err)
                        continue
                log.info("%s: text from Temporal: %s", child_id, err)
            break
        terminal: Done | Fault | None = None
        if not direct_end and not await self._hosts_prompts():
            skip = len("".join(sent))
            async for event in self._follow(child_id, result_task, poll_cooldown_ms, start):
                if not isinstance(event, TextDelta):
                    terminal = event
                    break
                delta, skip = _cut(event, skip)
                if delta is None:
                    continue
                event = delta
                sent.append(event.text)
                tokens += event.tokens or 0
                yield event
        result = terminal if terminal is not None else cast(Done | Fault, await result_task)
        so_far = "".join(sent)
        # A Done holds the whole text; a run-hosted prompt's Fault what it had (DECISIONS 66).
        whole = result.final_text if isinstance(result, Done) else result.text
        if whole is not None and whole.startswith(so_far):
            rest = whole[len(so_far) :]
            if rest:
                # The tokens it holds, so that a usage summed from the deltas is whole.
                total = result.tokens_generated  # None: a node that does not say
                yield TextDelta(
                    request_id=result.request_id,
                    text=rest,
                    tokens=None if total is None else max(0, total - tokens),
                )
        yield result

    async def _new_head(
        self, old: TextStreamTarget, result_task: asyncio.Future[Any]
    ) -> TextStreamTarget | None:
        """The head node's text stream once another node is the head (a stage recovery
        replaced it); None if the prompt ends first."""
        while not result_task.done():
            state = await self.try_snapshot()
            if state is not None and self._secret is not None:
                target = target_of(state, self.workflow_id, self._secret)
                if target is not None and (target.host, target.port) != (old.host, old.port):
                    self._target = target
                    return target
            await asyncio.wait({result_task}, timeout=NEW_HEAD_POLL_S)
        return None

    async def _text_target(self) -> TextStreamTarget | None:
        """The run's head node text stream, where this host can read it (cached)."""
        if self._secret is None:
            return None
        if self._target is None:
            state = await self.try_snapshot()
            if state is not None:
                self._prompt_host = state.prompt_host
                self._target = target_of(state, self.workflow_id, self._secret)
        return self._target

    async def _hosts_prompts(self) -> bool:
        """The run serves its prompts itself (DECISIONS 66): they have no workflow, so no
        Temporal text stream (their text comes from the head node or with their end)."""
        if self._prompt_host is None:
            state = await self.try_snapshot()
            if state is None:
                return False
            self._prompt_host = state.prompt_host
        return self._prompt_host is PromptHost.RUN

    async def _direct(
        self, target: TextStreamTarget, child_id: str, result_task: asyncio.Future[Any]
    ) -> AsyncGenerator[TextDelta, None]:
        """The head node's deltas of the prompt until its end line. A prompt that ends
        without generating (cancelled in the queue, refused) never opens there: once its
        result is in, what the node still sends within DIRECT_GRACE_S is taken, no more."""
        deltas = read_text(target, child_id)
        step: asyncio.Future[TextDelta] | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(deltas))
                done, _ = await asyncio.wait({step, result_task}, return_when=FIRST)
                if step not in done:
                    done, _ = await asyncio.wait({step}, timeout=DIRECT_GRACE_S)
                    if step not in done:
                        step.cancel()
                        with contextlib.suppress(BaseException):
                            await step
                        raise TextStreamError("the prompt ended without its text stream")
                try:
                    delta = step.result()
                except StopAsyncIteration:
                    return
                step = None
                yield delta
        finally:
            if step is not None and not step.done():
                step.cancel()  # the generator runs in it: let it stop before closing it
                with contextlib.suppress(BaseException):
                    await step
            with contextlib.suppress(Exception):
                await deltas.aclose()

    async def _follow(
        self,
        child_id: str,
        result_task: asyncio.Future[Any],
        poll_cooldown_ms: int,
        start: int = 0,
    ) -> PromptEvents:
        """The events of the prompt workflow's stream up to its terminal event; nothing
        more once the prompt has ended without one reaching the stream."""
        stream = WorkflowStreamClient.create(self.client, child_id)
        attempts = 0
        while True:
            try:
                async for item in stream.subscribe(
                    [names.PROMPT_STREAM_TOPIC],
                    from_offset=start,
                    result_type=None,
                    poll_cooldown=timedelta(milliseconds=poll_cooldown_ms),
                ):
                    event = _EVENT.validate_python(item.data)
                    yield event
                    if not isinstance(event, TextDelta):
                        return
                return
            except RPCError:
                # The child is started by the Update handler a moment after acceptance.
                attempts += 1
                if result_task.done() or attempts > 200:
                    return
                await asyncio.sleep(0.02)

    async def find_prompt(self, request_id: int) -> str | None:
        """The workflow id (a run-hosted prompt: its key) of this run's prompt
        ``request_id``: one in flight from the run's own snapshot, else the newest finished
        one (a request id can be used again once its prompt ended)."""
        found = await self.locate(request_id)
        return found.workflow_id if found is not None else None

    async def locate(self, request_id: int) -> PromptLocation | None:
        """Where prompt ``request_id`` is: in flight (the snapshot), finished in a
        PromptWorkflow (visibility), or finished in the run itself (the run's query).
        None: the run answered and has no such prompt; PromptUnavailable: it could not
        answer now (no worker has it: try again)."""
        state = await self.try_snapshot()  # None: a closed run, or one no worker has now
        if state is not None:
            self._prompt_host = state.prompt_host
            record = state.prompt(request_id)
            hosted = state.prompt_host is PromptHost.RUN
            if record is not None:
                return PromptLocation(
                    record.workflow_id, request_id, hosted, update_id=record.update_id
                )
            if hosted:
                return await self._served(request_id)
        prefix = names.prompt_workflow_id(self.run_id, request_id, "")
        query = f"WorkflowType = '{names.PROMPT_WORKFLOW}' AND WorkflowId STARTS_WITH '{prefix}'"
        newest: tuple[Any, str] | None = None
        async for wf in self.client.list_workflows(query):
            if newest is None or wf.start_time > newest[0]:
                newest = (wf.start_time, wf.id)
        if newest is not None:
            return PromptLocation(newest[1], request_id)
        if state is not None:
            return None
        try:  # a closed run that served its prompts itself answers for its last ones
            return await self._served(request_id)
        except PromptUnavailable:
            if self._prompt_host is PromptHost.RUN:
                raise  # it may well have it: say so, not "no such prompt"
            return None

    async def _served(self, request_id: int) -> PromptLocation | None:
        served = await self.served(request_id)
        if served is None:
            return None
        return PromptLocation(served.workflow_id, request_id, True, served=served)

    async def served(self, request_id: int) -> ServedPrompt | None:
        """The newest run-hosted prompt ``request_id`` that ended, as the run keeps it
        (DECISIONS 66; a closed run answers too, while a worker replays it); None: not
        kept. PromptUnavailable: the run cannot answer now."""
        served = await self._ask(names.QUERY_PROMPT_SERVED, request_id, ServedPrompt)
        return served if isinstance(served, ServedPrompt) else None

    async def hosted_stops(self, request_id: int) -> list[str]:
        """The stop strings of run-hosted prompt ``request_id`` (in flight or kept)."""
        stops = await self._ask(names.QUERY_PROMPT_STOPS, request_id, list[str])
        return list(stops) if isinstance(stops, list) else []

    async def _ask(self, query: str, request_id: int, result_type: Any) -> Any:
        """One of the run's prompt queries; PromptUnavailable when the run cannot answer."""
        try:
            return await self.workflow.query(
                query, request_id, result_type=result_type, rpc_timeout=QUERY_TIMEOUT
            )
        except RPCError as err:
            if err.status is RPCStatusCode.NOT_FOUND:
                return None  # no such run
            raise PromptUnavailable(
                f"run {self.run_id} cannot say where prompt {request_id} is now: {err}"
            ) from None
        except (WorkflowQueryFailedError, WorkflowQueryRejectedError) as err:
            raise PromptUnavailable(
                f"run {self.run_id} cannot say where prompt {request_id} is now: {err}"
            ) from None

    async def attach(self, request_id: int, *, poll_cooldown_ms: int = 20) -> PromptEvents:
        """Re-attach to a prompt, running or finished, from any client: the whole text so
        far, then the rest as it is generated, then its one terminal event. Raises
        PromptNotFound when the run never admitted ``request_id``. A viewer: leaving it
        early cancels nothing."""
        found = await self.locate(request_id)
        if found is None:
            raise PromptNotFound(f"run {self.run_id} has no prompt {request_id}")
        ended = self._hosted_terminal(found) if found.hosted else self._prompt_terminal(found)
        result_task = asyncio.ensure_future(ended)
        try:
            async for event in self._events(found.workflow_id, result_task, poll_cooldown_ms):
                yield event
                if not isinstance(event, TextDelta):
                    return
        finally:
            _drop(result_task)

    async def _prompt_terminal(self, found: PromptLocation) -> Done | Fault:
        raw = await self.client.get_workflow_handle(found.workflow_id).result()
        return PromptOutcome.model_validate(raw).terminal

    async def _hosted_terminal(self, found: PromptLocation) -> Done | Fault:
        """A run-hosted prompt's end: kept by the run, or its Update's result (waited on,
        as its submitter waits)."""
        if found.served is not None:
            return found.served.outcome.terminal
        if found.update_id is not None:
            update = self.workflow.get_update_handle_for(RunWorkflow.submit_prompt, found.update_id)
            try:
                return cast(Done | Fault, await update.result())
            except WorkflowUpdateFailedError as err:
                raise PromptNotFound(f"prompt {found.workflow_id}: {err.cause or err}") from None
            except RPCError as err:
                if err.status is not RPCStatusCode.NOT_FOUND:
                    raise PromptUnavailable(f"prompt {found.workflow_id}: {err}") from None
                # Ended, and the run continued as new since: what it kept of the prompt.
        served = await self._served(found.request_id)
        if served is None or served.served is None or served.workflow_id != found.workflow_id:
            raise PromptNotFound(f"prompt {found.workflow_id}: no longer kept by its run")
        return served.served.outcome.terminal


@dataclass(frozen=True)
class PromptLocation:
    """A prompt located by its request id (RunHandle.locate)."""

    workflow_id: str
    request_id: int
    hosted: bool = False  # served by the run itself (DECISIONS 66)
    update_id: str | None = None  # a hosted one in flight: its Update
    served: ServedPrompt | None = None  # a hosted one that ended


# ---------------------------------------------------------------------- one-off calls


async def start_run(client: Client, run_id: int, request: RunRequest) -> WorkflowHandle[Any, Any]:
    """:meth:`RunHandle.start`, returning the workflow handle."""
    return (await RunHandle.start(client, run_id, request)).workflow


def stream_prompt(
    client: Client,
    run_id: int,
    prompt: SubmitPrompt,
    *,
    poll_cooldown_ms: int = 20,
    on_admitted: Callable[[], None] | None = None,
) -> PromptEvents:
    """:meth:`RunHandle.stream` (leaving it early cancels the prompt)."""
    return RunHandle(client, run_id).stream(
        prompt, poll_cooldown_ms=poll_cooldown_ms, on_admitted=on_admitted
    )


async def start_prompt(
    client: Client, run_id: int, prompt: SubmitPrompt
) -> WorkflowUpdateHandle[Any]:
    """:meth:`RunHandle.start_prompt`."""
    return await RunHandle(client, run_id).start_prompt(prompt)


def _cut(delta: TextDelta, skip: int) -> tuple[TextDelta | None, int]:
    """``delta`` less the first ``skip`` characters, which the reader has from another
    stream (None: all of it), and what is left to skip."""
    if not skip:
        return delta, 0
    cut = min(skip, len(delta.text))
    if cut == len(delta.text):
        return None, skip - cut
    return delta.model_copy(update={"text": delta.text[cut:]}), skip - cut


async def submit_prompt(client: Client, run_id: int, prompt: SubmitPrompt) -> Done | Fault:
    """:meth:`RunHandle.submit`."""
    return await RunHandle(client, run_id).submit(prompt)


async def find_prompt(client: Client, run_id: int, request_id: int) -> str | None:
    """:meth:`RunHandle.find_prompt`."""
    return await RunHandle(client, run_id).find_prompt(request_id)


def attach_prompt(
    client: Client, run_id: int, request_id: int, *, poll_cooldown_ms: int = 20
) -> PromptEvents:
    """:meth:`RunHandle.attach`."""
    return RunHandle(client, run_id).attach(request_id, poll_cooldown_ms=poll_cooldown_ms)
