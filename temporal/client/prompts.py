"""A prompt from submission to its end: admitted by the run's ``submit_prompt`` Update
(a refusal is a typed PromptRejected), streamed, or cancelled (``cancel_prompt``). A
stream owns its prompt: left before its terminal event, it cancels it (DECISIONS 55)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from temporalio.client import (
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateHandle,
    WorkflowUpdateRPCTimeoutOrCancelledError,
    WorkflowUpdateStage,
)
from temporalio.service import RPCError

from mvp_core import names
from mvp_core.errors import ErrorType
from mvp_core.models import (
    AdmissionAnswer,
    CancelPrompt,
    Done,
    Fault,
    PromptAdmission,
    PromptAdmissions,
    PromptAdmitted,
    SubmitPrompt,
    TextDelta,
)
from mvp_core.run_signals import signal_name
from temporal.client.admissions import Admissions
from temporal.client.ends import EndHint
from temporal.client.errors import PromptRejected, rejection
from temporal.client.refusals import quick_client
from temporal.client.text import EarlyText, PromptEvents, PromptText
from temporal.client.updates import OUTCOME_PEEK, drop, resent_when_not_ready
from workflows.run import RunWorkflow

CANCEL_TIMEOUT_S = 5.0  # a cancel_prompt signal that takes longer is given up
ADMIT_WAIT_S = 30.0  # a stream cancelled while its admission is in flight waits this long
# Refusals an end the run has not counted yet can cause (DECISIONS 95).
COUNTED_LATE = frozenset({ErrorType.PROMPT_QUEUE_FULL.value, ErrorType.DUPLICATE_REQUEST_ID.value})


class PromptCalls(PromptText):
    """Submit, stream and cancel the run's prompts."""

    async def _admit(self, prompt: SubmitPrompt, update_id: str) -> PromptAdmitted:
        """Admit the prompt with the ``admit_prompt`` Update, or with others waiting in one
        ``admit_prompts`` (DECISIONS 77, 106): it answers once the run has admitted it,
        and holds nothing open while it runs. A refusal raises PromptRejected."""
        if self._admissions is None:
            self._admissions = Admissions(self._admit_one, self._admit_many)
        for attempt in range(2):
            try:
                admitted = await self._admissions.admit(prompt, update_id)
                break
            except PromptRejected as refused:
                # An end this handle took from a head node's end line may not be counted
                # by the run yet (DECISIONS 95): its slot or request id is then free a
                # workflow task later. Asked again once the run has counted it.
                if attempt == 0 and refused.kind in COUNTED_LATE and await self.wait_ends_counted():
                    update_id = uuid.uuid4().hex
                    continue
                raise
        self._cancelled.discard(prompt.request_id)  # a new prompt of this id
        return admitted

    async def _updates_to(self) -> WorkflowHandle[Any, Any]:
        """The run's handle the admissions' Updates go to."""
        if self._quick_refusals:
            return (await quick_client(self.client)).get_workflow_handle(self.workflow_id)
        return self.workflow

    async def _admit_one(self, prompt: SubmitPrompt, update_id: str) -> PromptAdmitted:
        workflow = await self._updates_to()
        try:
            return await resent_when_not_ready(
                lambda: workflow.execute_update(RunWorkflow.admit_prompt, prompt, id=update_id)
            )
        except WorkflowUpdateFailedError as err:
            raise rejection(err) from None

    async def _admit_many(self, items: list[PromptAdmission]) -> list[AdmissionAnswer]:
        workflow = await self._updates_to()
        update_id = uuid.uuid4().hex  # the same for each send again
        try:
            answers = await resent_when_not_ready(
                lambda: workflow.execute_update(
                    RunWorkflow.admit_prompts, PromptAdmissions(items=items), id=update_id
                )
            )
        except WorkflowUpdateFailedError as err:
            raise rejection(err) from None
        return answers.answers

    async def start_prompt(self, prompt: SubmitPrompt) -> WorkflowUpdateHandle[Any]:
        """Submit with the spec's ``submit_prompt`` Update and return once the run has
        admitted the prompt (FIFO from here on); raises PromptRejected when the run refuses
        it. The handle's ``result()`` is the prompt's Done or Fault; the Update is in
        flight until then, and a server allows few such per run (DECISIONS 77)."""
        try:
            # (Any: the SDK types an async handler's result as its coroutine)
            update: WorkflowUpdateHandle[Any] = await resent_when_not_ready(
                lambda: self.workflow.start_update(
                    RunWorkflow.submit_prompt,
                    prompt,
                    id=uuid.uuid4().hex,
                    wait_for_stage=WorkflowUpdateStage.ACCEPTED,
                )
            )
            # Known outcome: a rejection raises here (a prompt already done returns);
            # none known: the peek gives up at once, and the prompt is admitted.
            with contextlib.suppress(WorkflowUpdateRPCTimeoutOrCancelledError, RPCError):
                await update.result(rpc_timeout=OUTCOME_PEEK)
        except WorkflowUpdateFailedError as err:
            raise rejection(err) from None
        self._cancelled.discard(prompt.request_id)
        return update

    async def admit(self, prompt: SubmitPrompt) -> PromptAdmitted:
        """Submit and return once the run has admitted the prompt (FIFO from here on);
        raises PromptRejected when the run refuses it. Its end: ``prompt_end``."""
        return await self._admit(prompt, uuid.uuid4().hex)

    async def submit(self, prompt: SubmitPrompt) -> Done | Fault:
        """Submit and wait for the terminal event, without streaming."""
        admitted = await self._admit(prompt, uuid.uuid4().hex)
        return await self.prompt_end(
            admitted.prompt_id, admitted.request_id, hosted=admitted.hosted
        )

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

    def _early_text(self, prompt: SubmitPrompt, update_id: str) -> EarlyText | None:
        """The prompt's text stream opened now, before its admission, asking the head node
        to start it at once (DECISIONS 103): where this handle reads the run's text with
        the deployment's secret and already knows the head (no query before the Update),
        and the run will hand the head this very prompt (its cap set; greedy or seeded,
        so no seed is drawn at admission)."""
        target = self._target
        run_id = names.run_id_from_workflow_id(self.workflow_id)
        if (
            not self._early_start
            or target is None
            or target.token is None
            or run_id is None
            or not prompt.max_tokens
            or (prompt.temperature > 0 and prompt.seed is None)
        ):
            return None
        key = names.prompt_workflow_id(run_id, prompt.request_id, names.update_key(update_id))
        return EarlyText(key, target, prompt)

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
        prompt nobody reads. A handle without the deployment's edge secret admits the
        prompt with a random ``text_key`` of its own, and reads its text with it straight
        from the head node (DECISIONS 80)."""
        if self._direct_text and self._secret is None and prompt.text_key is None:
            prompt = prompt.model_copy(update={"text_key": secrets.token_hex(16)})
        update_id = uuid.uuid4().hex
        early = self._early_text(prompt, update_id)
        admit = asyncio.ensure_future(self._admit(prompt, update_id))
        try:
            admitted = await asyncio.shield(admit)
        except asyncio.CancelledError:
            self._spawn(self._cancel_when_admitted(admit, prompt.request_id))
            if early is not None:
                self._spawn(early.close())
            raise
        except BaseException:
            if early is not None:
                await early.close()
            raise
        if early is not None and early.key != admitted.prompt_id:
            await early.close()  # admitted under another id (asked again): not that one
            early = None
        try:
            if on_admitted is not None:
                on_admitted()
            hint = EndHint(reader=True)
            result_task: asyncio.Future[Done | Fault] = asyncio.ensure_future(
                self.prompt_end(
                    admitted.prompt_id, prompt.request_id, hosted=admitted.hosted, hint=hint
                )
            )
        except BaseException:
            if early is not None:
                await early.close()
            raise
        terminal: Done | Fault | None = None
        try:
            async for event in self._events(
                admitted.prompt_id,
                result_task,
                poll_cooldown_ms,
                hint=hint,
                key=prompt.text_key,
                early=early,
            ):
                if isinstance(event, TextDelta):
                    yield event
                else:
                    terminal = event
                    break
            result = await result_task
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
            if early is not None:  # read to its end or not: closed either way
                await early.close()
