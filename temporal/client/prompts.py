"""A prompt from submission to its end: admitted by the run's ``submit_prompt`` Update
(a refusal is a typed PromptRejected), streamed, or cancelled (``cancel_prompt``). A
stream owns its prompt: left before its terminal event, it cancels it (DECISIONS 55)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

from temporalio.client import (
    WorkflowUpdateFailedError,
    WorkflowUpdateHandle,
    WorkflowUpdateRPCTimeoutOrCancelledError,
    WorkflowUpdateStage,
)
from temporalio.service import RPCError

from mvp_core import names
from mvp_core.models import CancelPrompt, Done, Fault, SubmitPrompt, TextDelta
from mvp_core.run_signals import signal_name
from temporal.client.errors import rejection
from temporal.client.text import PromptEvents, PromptText
from temporal.client.updates import OUTCOME_PEEK, drop, resent_when_not_ready
from workflows.run import RunWorkflow

CANCEL_TIMEOUT_S = 5.0  # a cancel_prompt signal that takes longer is given up
ADMIT_WAIT_S = 30.0  # a stream cancelled while its admission is in flight waits this long


class PromptCalls(PromptText):
    """Submit, stream and cancel the run's prompts."""

    async def _admit(self, prompt: SubmitPrompt, update_id: str) -> WorkflowUpdateHandle[Any]:
        """Start the ``submit_prompt`` Update and return its handle once the run admitted
        the prompt; a refusal raises PromptRejected.

        A validator's rejection comes back as an Update already completed with a failure
        (the server answers the ACCEPTED wait with the outcome): it is read at once here,
        so the caller never holds a handle for a prompt that was not admitted."""
        try:
            # (Any: the SDK types an async handler's result as its coroutine)
            update: WorkflowUpdateHandle[Any] = await resent_when_not_ready(
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
                await update.result(rpc_timeout=OUTCOME_PEEK)
        except WorkflowUpdateFailedError as err:
            raise rejection(err) from None
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
            result = await resent_when_not_ready(
                lambda: self.workflow.execute_update(
                    RunWorkflow.submit_prompt, prompt, id=update_id
                )
            )
        except WorkflowUpdateFailedError as err:
            raise rejection(err) from None
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
                cancel = CancelPrompt(request_id=request_id)
                await self.workflow.signal(signal_name(cancel), cancel)

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
            drop(admit)

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
            drop(result_task)
