"""A small client API: submit a prompt to a run and read its text as it is generated.

    async for event in stream_prompt(client, run_id=7, prompt=SubmitPrompt(...)):
        if isinstance(event, TextDelta): print(event.text, end="", flush=True)
        else: ...  # Done or Fault, always last, exactly once

The prompt is admitted by the run's ``submit_prompt`` Update (its validator rejects a
full queue, a duplicate id, or a run that is not prompt-ready, raising ``PromptRejected``);
its text deltas come from the prompt's own workflow stream, which any client can
subscribe to and re-attach to; the terminal event is the Update's result.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

from pydantic import TypeAdapter
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
    WorkflowUpdateHandle,
    WorkflowUpdateStage,
)
from temporalio.contrib.workflow_streams import WorkflowStreamClient
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from mvp_core import names
from mvp_core.models import (
    Done,
    Fault,
    PromptEvent,
    PromptOutcome,
    PromptTerminal,
    RunRequest,
    SubmitPrompt,
    TextDelta,
)
from mvp_core.run_state import RunState

_EVENT: TypeAdapter[TextDelta | Done | Fault] = TypeAdapter(PromptEvent)
_TERMINAL: Any = PromptTerminal


async def start_run(client: Client, run_id: int, request: RunRequest) -> WorkflowHandle[Any, Any]:
    """Start run ``run_id`` (workflow ``mvp-run-<run_id>``) as the docs say, with the short
    workflow task timeout that lets another worker take over a lost task quickly."""
    handle: WorkflowHandle[Any, Any] = await client.start_workflow(
        names.RUN_WORKFLOW,
        request,
        id=names.run_workflow_id(run_id),
        task_queue=names.ORCHESTRATOR_TASK_QUEUE,
        task_timeout=timedelta(seconds=names.WORKFLOW_TASK_TIMEOUT_S),
        # What the Web UI lists for the run (its live details come from the run itself).
        static_summary=run_summary(run_id, request),
    )
    return handle


def run_summary(run_id: int, request: RunRequest) -> str:
    """``run 7: SmolLM2-135M-Instruct.Q4_1, 2 stage(s) on process``: ids and names only."""
    model = request.model.display_name() or "the default model"
    return (
        f"run {run_id}: {model[:120]}, {request.pipeline_stages} stage(s) on "
        f"{request.provider.value}"
    )


class PromptRejected(Exception):
    """The run refused the prompt; ``kind`` is the typed rejection (DECISIONS 9)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _rejection(err: WorkflowUpdateFailedError) -> PromptRejected:
    cause = err.cause
    if isinstance(cause, ApplicationError):
        return PromptRejected(cause.type or "Rejected", cause.message)
    return PromptRejected("Rejected", str(cause or err))


async def _admit(client: Client, run_id: int, prompt: SubmitPrompt, update_id: str) -> Any:
    """Start the ``submit_prompt`` Update and return its handle once the run admitted the
    prompt; a refusal raises PromptRejected.

    A validator's rejection comes back as an Update already completed with a failure
    (the server answers the ACCEPTED wait with the outcome): it is read at once here,
    so the caller never holds a handle for a prompt that was not admitted.
    """
    handle = client.get_workflow_handle(names.run_workflow_id(run_id))
    try:
        update = await handle.start_update(
            names.UPDATE_SUBMIT_PROMPT,
            prompt,
            id=update_id,
            wait_for_stage=WorkflowUpdateStage.ACCEPTED,
            result_type=_TERMINAL,
        )
        outcome = getattr(update, "_known_outcome", None)
        if outcome is not None and outcome.HasField("failure"):
            await update.result()  # raises the rejection, without another RPC
    except WorkflowUpdateFailedError as err:
        raise _rejection(err) from None
    return update


async def stream_prompt(
    client: Client,
    run_id: int,
    prompt: SubmitPrompt,
    *,
    poll_cooldown_ms: int = 20,
    on_admitted: Callable[[], None] | None = None,
) -> AsyncIterator[TextDelta | Done | Fault]:
    """Yield the prompt's TextDelta events as they arrive, then its one terminal event.
    ``on_admitted`` is called once the run has admitted the prompt (its place in the
    run's FIFO is fixed from then on)."""
    update_id = uuid.uuid4().hex
    update = await _admit(client, run_id, prompt, update_id)
    if on_admitted is not None:
        on_admitted()
    child_id = names.prompt_workflow_id(run_id, prompt.request_id, update_id)
    stream = WorkflowStreamClient.create(client, child_id)
    result_task = asyncio.ensure_future(update.result())
    terminal: Done | Fault | None = None
    attempts = 0
    while terminal is None:
        try:
            async for item in stream.subscribe(
                [names.PROMPT_STREAM_TOPIC],
                result_type=None,
                poll_cooldown=timedelta(milliseconds=poll_cooldown_ms),
            ):
                event = _EVENT.validate_python(item.data)
                if isinstance(event, TextDelta):
                    yield event
                else:
                    terminal = event
                    break
            if terminal is None:
                break
        except RPCError:
            # The child is started by the Update handler a moment after acceptance.
            attempts += 1
            if result_task.done() or attempts > 200:
                break
            await asyncio.sleep(0.02)
    result = await result_task
    yield terminal if terminal is not None else result


async def start_prompt(
    client: Client, run_id: int, prompt: SubmitPrompt
) -> WorkflowUpdateHandle[Any]:
    """Submit and return once the run has admitted the prompt (FIFO from here on);
    raises PromptRejected when the run refuses it."""
    handle: WorkflowUpdateHandle[Any] = await _admit(client, run_id, prompt, uuid.uuid4().hex)
    return handle


async def submit_prompt(client: Client, run_id: int, prompt: SubmitPrompt) -> Done | Fault:
    """Submit and wait for the terminal event, without streaming."""
    handle = client.get_workflow_handle(names.run_workflow_id(run_id))
    try:
        result: Done | Fault = await handle.execute_update(
            names.UPDATE_SUBMIT_PROMPT,
            prompt,
            result_type=_TERMINAL,
        )
    except WorkflowUpdateFailedError as err:
        raise _rejection(err) from None
    return result


class PromptNotFound(LookupError):
    """No prompt of that request id was ever admitted by the run."""


async def find_prompt(client: Client, run_id: int, request_id: int) -> str | None:
    """The workflow id of run ``run_id``'s prompt ``request_id``: one in flight from the
    run's own snapshot, else the newest finished one from visibility (a request id can be
    used again once its prompt ended)."""
    try:
        state: RunState = await client.get_workflow_handle(names.run_workflow_id(run_id)).query(
            names.QUERY_SNAPSHOT, result_type=RunState
        )
        for record in [state.active, *state.pending]:
            if record is not None and record.request_id == request_id:
                return record.workflow_id
    except (RPCError, WorkflowQueryFailedError):
        pass  # a closed run: its prompts are in visibility
    prefix = names.prompt_workflow_id(run_id, request_id, "")
    query = f"WorkflowType = '{names.PROMPT_WORKFLOW}' AND WorkflowId STARTS_WITH '{prefix}'"
    newest: tuple[Any, str] | None = None
    async for wf in client.list_workflows(query):
        if newest is None or wf.start_time > newest[0]:
            newest = (wf.start_time, wf.id)
    return newest[1] if newest else None


async def attach_prompt(
    client: Client, run_id: int, request_id: int, *, poll_cooldown_ms: int = 20
) -> AsyncIterator[TextDelta | Done | Fault]:
    """Re-attach to a prompt, running or finished, from any client: the whole text so far,
    then the rest as it is generated, then its one terminal event. Raises PromptNotFound
    when the run never admitted ``request_id``."""
    wf_id = await find_prompt(client, run_id, request_id)
    if wf_id is None:
        raise PromptNotFound(f"run {run_id} has no prompt {request_id}")
    stream = WorkflowStreamClient.create(client, wf_id)
    seen: list[str] = []
    terminal: Done | Fault | None = None
    try:
        async for item in stream.subscribe(
            [names.PROMPT_STREAM_TOPIC],
            from_offset=0,
            result_type=None,
            poll_cooldown=timedelta(milliseconds=poll_cooldown_ms),
        ):
            event = _EVENT.validate_python(item.data)
            if isinstance(event, TextDelta):
                seen.append(event.text)
                yield event
            else:
                terminal = event
                break
    except RPCError:
        pass  # a stream no longer retained: the prompt's result has its whole text
    if terminal is None:
        raw = await client.get_workflow_handle(wf_id).result()
        terminal = PromptOutcome.model_validate(raw).terminal
        so_far = "".join(seen)
        if isinstance(terminal, Done) and terminal.final_text.startswith(so_far):
            rest = terminal.final_text[len(so_far) :]
            if rest:
                yield TextDelta(request_id=request_id, text=rest)
    yield terminal


class RunNotOpen(Exception):
    """The run does not exist, cannot be described, or has ended (the message says which)."""


async def check_run_open(handle: WorkflowHandle[Any, Any], address: str) -> None:
    """Raise RunNotOpen unless the run behind ``handle`` exists and is running."""
    try:
        desc = await handle.describe()
    except RPCError as err:
        if err.status is RPCStatusCode.NOT_FOUND:
            raise RunNotOpen(f"no run {handle.id} on {address}") from None
        raise RunNotOpen(f"cannot describe run {handle.id} on {address}: {err}") from None
    if desc.status is not WorkflowExecutionStatus.RUNNING:
        status = desc.status.name.lower() if desc.status else "closed"
        raise RunNotOpen(f"run {handle.id} has ended ({status})")
