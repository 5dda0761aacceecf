"""A prompt's end, without an Update in flight while it runs (DECISIONS 77): a prompt
admitted by ``admit_prompt`` ends as its PromptWorkflow's result (a long poll on that
workflow, not on the run), or, served by the run itself, as the run's ``prompt_end``
query answers it. That query is asked rarely while the prompt's text still comes from
its head node, and at once, then often for a moment, when that text has ended.

A handle asks for every prompt it waits on in one ``prompt_ends`` query, one at a time
(DECISIONS 78): a server buffers one query per busy workflow by default
(``history.MaxBufferedQueryCount``) and refuses the rest, so 64 streams each asking on
its own were refused, retried, and late."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from temporalio.client import WorkflowFailureError
from temporalio.service import RPCError, RPCStatusCode

from mvp_core import names
from mvp_core.models import Done, Fault, PromptEnd, PromptOutcome
from temporal.client.endboard import EndBoard
from temporal.client.errors import PromptNotFound, PromptUnavailable
from temporal.client.lifecycle import RunLifecycle

# While the prompt's text still comes from its head node, its end is looked for this
# often (it normally comes right after the text's end line, which wakes the look at once);
# without such a stream (no edge secret) more often, since nothing else says it is near.
END_POLL_WHILE_STREAMING_S = 5.0
END_POLL_S = (0.25, 1.0)  # first and longest pause between looks without a stream
END_POLL_AFTER_TEXT_S = (0.01, 0.25)  # ... and once the text has ended
# A run that cannot answer (no worker has it now) is asked again this many times.
UNANSWERED_RETRIES = 60


class EndHint:
    """What the reader of a prompt's text tells the wait for its end: a direct stream is
    open (``streaming``: the end is not near before its end line), and its end line came
    (``text_ended``: the end follows within a workflow task or two)."""

    def __init__(self) -> None:
        self.streaming = False
        self.text_ended = asyncio.Event()


class PromptEnds(RunLifecycle):
    """Waiting for a prompt's one terminal event once it was admitted."""

    async def prompt_end(
        self, prompt_id: str, request_id: int, *, hosted: bool, hint: EndHint | None = None
    ) -> Done | Fault:
        """The terminal event of prompt ``prompt_id`` (``PromptAdmitted.prompt_id``)."""
        if hosted:
            return await self._hosted_end(prompt_id, hint or EndHint())
        return await self._workflow_end(prompt_id, request_id)

    async def _workflow_end(self, prompt_id: str, request_id: int) -> Done | Fault:
        """A PromptWorkflow's result (a long poll on that workflow), once the run has
        counted its end too: so a client that sends its next prompt, or reads the run's
        figures, right after an end finds the run past it, as after submit_prompt."""
        terminal = await self._child_result(prompt_id, request_id)
        pause = END_POLL_AFTER_TEXT_S[0]
        unanswered = 0
        while True:
            try:
                end = await self._ask_end(prompt_id)
            except PromptUnavailable:
                unanswered += 1
                if unanswered > UNANSWERED_RETRIES:
                    return terminal  # the end is in hand; the run cannot say it counted it
                end = PromptEnd(prompt_id=prompt_id, open=True)
            if end is None or not end.open:
                return terminal
            await asyncio.sleep(pause)
            pause = min(pause * 2, END_POLL_AFTER_TEXT_S[1])

    async def _child_result(self, prompt_id: str, request_id: int) -> Done | Fault:
        handle = self.client.get_workflow_handle(prompt_id)
        pause = 0.02
        closed_before = False  # the run had ended the prompt at the last "not found"
        while True:
            try:
                raw = await handle.result()
            except WorkflowFailureError as err:
                # The run takes a failed PromptWorkflow for a Fault of the prompt (and
                # faults itself): its client sees that Fault.
                return Fault(request_id=request_id, error=f"prompt workflow failed: {err}")
            except RPCError as err:
                if err.status is not RPCStatusCode.NOT_FOUND:
                    raise PromptUnavailable(f"prompt {prompt_id}: {err}") from None
                # Started just after its admission was answered, or not yet (a busy
                # run): waited for while the run has the prompt. One that ran and ended
                # while this look was on its way (the run may even have continued as new
                # since, and no longer knows it) is looked for once more.
                try:
                    end = await self._ask_end(prompt_id)
                except PromptUnavailable:  # no worker has the run this moment
                    end = PromptEnd(prompt_id=prompt_id, open=True)
                closed = end is None or not end.open
                if closed and closed_before:
                    raise PromptNotFound(
                        f"prompt {prompt_id}: the run has no such prompt workflow"
                    ) from None
                closed_before = closed
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
                continue
            return PromptOutcome.model_validate(raw).terminal

    async def _hosted_end(self, prompt_id: str, hint: EndHint) -> Done | Fault:
        pause, after = END_POLL_S[0], 0.0
        unanswered = 0
        while True:
            try:
                end = await self._ask_end(prompt_id)
            except PromptUnavailable:
                unanswered += 1
                if unanswered > UNANSWERED_RETRIES:
                    raise
                end = PromptEnd(prompt_id=prompt_id, open=True)
            if end is None:
                raise PromptNotFound(f"run {self.run_id} keeps no prompt {prompt_id}")
            if end.terminal is not None:
                return end.terminal
            if hint.text_ended.is_set():
                low, high = END_POLL_AFTER_TEXT_S
                after = min(after * 2, high) if after else low
                await asyncio.sleep(after)
                continue
            wait = END_POLL_WHILE_STREAMING_S if hint.streaming else pause
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await hint.text_ended.wait()
            if not hint.streaming:
                pause = min(pause * 1.5, END_POLL_S[1])

    async def _ask_end(self, prompt_id: str) -> PromptEnd | None:
        """What the run says of ``prompt_id`` (with every other prompt this handle waits
        on: one ``prompt_ends`` query). PromptNotFound: no such run; PromptUnavailable:
        it cannot answer now."""
        if self._end_board is None:
            self._end_board = EndBoard(self._ask_ends)
        return await self._end_board.look(prompt_id)

    async def _ask_ends(self, prompt_ids: list[str]) -> list[PromptEnd | None]:
        if not self._ends_in_one:  # a run worker older than prompt_ends: one by one
            return [await self._ask_one_end(p) for p in prompt_ids]
        try:
            answer: Any = await self._ask_run(
                names.QUERY_PROMPT_ENDS, prompt_ids, list[PromptEnd | None], "its prompts"
            )
        except PromptUnavailable as err:
            if f"'{names.QUERY_PROMPT_ENDS}' expected but not found" not in str(err):
                raise
            self._ends_in_one = False
            return [await self._ask_one_end(p) for p in prompt_ids]
        if not isinstance(answer, list):
            raise PromptUnavailable(f"run {self.run_id} answered no list of ends")
        return [end if isinstance(end, PromptEnd) else None for end in answer]

    async def _ask_one_end(self, prompt_id: str) -> PromptEnd | None:
        answer: Any = await self._ask_run(
            names.QUERY_PROMPT_END, prompt_id, PromptEnd, f"prompt {prompt_id}"
        )
        return answer if isinstance(answer, PromptEnd) else None
