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
import math
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
# Ends taken from end lines that the run may not have counted yet (DECISIONS 95): the
# latest this many are remembered, and a refused admission waits this long at most for
# the run to count them.
ENDS_TO_COUNT_HELD = 256
COUNT_WAIT_S = 10.0
STOP_COUNT_WAIT_S = 3.0  # ... and a stop this long


async def _either(a: asyncio.Event, b: asyncio.Event) -> None:
    """Until ``a`` or ``b`` is set."""
    waits = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def streaming_look_in(period: float | None = None) -> float:
    """Seconds to a streaming prompt's next look for its end: the next multiple of
    ``period`` (END_POLL_WHILE_STREAMING_S) at least half a period away. Every streaming
    prompt looks at the same instants of the event loop's clock, so one ``prompt_ends`` query
    (EndBoard) asks for all of a handle's: at 64 streams ~0.2 queries a second, not one
    per stream per period (DECISIONS 101)."""
    period = END_POLL_WHILE_STREAMING_S if period is None else period
    now = asyncio.get_running_loop().time()
    return (math.floor((now + period / 2) / period) + 1) * period - now


class EndHint:
    """What the reader of a prompt's text tells the wait for its end: a direct stream is
    open (``streaming``: the end is not near before its end line), and its end line came
    (``text_ended``: the end follows within a workflow task or two), with the prompt's
    Done where the line carried it (``terminal``, DECISIONS 95: then it is the end)."""

    def __init__(self, *, reader: bool = False) -> None:
        """``reader``: a reader of the prompt's text will say (``decided``) whether a
        direct stream is open before the wait asks the run anything."""
        self.streaming = False
        self.text_ended = asyncio.Event()
        self.stream_closed = asyncio.Event()  # the direct stream ended, its end line or not
        self.terminal: Done | None = None
        self.decided = asyncio.Event()
        if not reader:
            self.decided.set()


class PromptEnds(RunLifecycle):
    """Waiting for a prompt's one terminal event once it was admitted."""

    async def prompt_end(
        self, prompt_id: str, request_id: int, *, hosted: bool, hint: EndHint | None = None
    ) -> Done | Fault:
        """The terminal event of prompt ``prompt_id`` (``PromptAdmitted.prompt_id``)."""
        hint = hint or EndHint()
        if hosted:
            return await self._hosted_end(prompt_id, request_id, hint)
        return await self._workflow_end(prompt_id, request_id, hint)

    def _told_end(self, prompt_id: str, request_id: int, hint: EndHint) -> Done | None:
        """The Done the head node's end line carried (DECISIONS 95), noted as an end the
        run has yet to count; None without one."""
        done = hint.terminal
        if done is None or done.request_id != request_id:
            return None
        self._ends_to_count[prompt_id] = request_id
        while len(self._ends_to_count) > ENDS_TO_COUNT_HELD:
            del self._ends_to_count[next(iter(self._ends_to_count))]
        return done

    async def wait_ends_counted(self, within_s: float = COUNT_WAIT_S) -> bool:
        """Until the run has counted every end this handle took from an end line (at most
        ``within_s``; a prompt the run cannot be asked about is not waited for); whether
        there were any. A refused admission (a full queue, a request id in use) waits for
        them before it is tried again, and a stop before it is sent (so the run records
        the ends its client saw before the stop): the run may not have counted them yet."""
        if not self._ends_to_count:
            return False
        deadline = asyncio.get_running_loop().time() + within_s
        pause = END_POLL_AFTER_TEXT_S[0]
        while self._ends_to_count:
            ids = list(self._ends_to_count)
            ends = await asyncio.gather(*map(self._ask_end, ids), return_exceptions=True)
            for prompt_id, end in zip(ids, ends, strict=True):
                if isinstance(end, BaseException) or end is None or not end.open:
                    self._ends_to_count.pop(prompt_id, None)
            if not self._ends_to_count or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(pause)
            pause = min(pause * 2, END_POLL_AFTER_TEXT_S[1])
        self._ends_to_count.clear()
        return True

    async def _settle_ends(self) -> None:
        await self.wait_ends_counted(STOP_COUNT_WAIT_S)

    async def _workflow_end(self, prompt_id: str, request_id: int, hint: EndHint) -> Done | Fault:
        """A PromptWorkflow's result (a long poll on that workflow), once the run has
        counted its end too: so a client that sends its next prompt, or reads the run's
        figures, right after an end finds the run past it, as after submit_prompt. Where
        the head node's end line carried the prompt's Done, that Done (DECISIONS 95)."""
        child = asyncio.ensure_future(self._child_result(prompt_id, request_id))
        told = asyncio.ensure_future(hint.text_ended.wait())
        try:
            await asyncio.wait({child, told}, return_when=asyncio.FIRST_COMPLETED)
            if not child.done() and (done := self._told_end(prompt_id, request_id, hint)):
                return done
            terminal = await child
        finally:
            for task in (child, told):
                task.cancel()
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

    async def _hosted_end(self, prompt_id: str, request_id: int, hint: EndHint) -> Done | Fault:
        pause, after = END_POLL_S[0], 0.0
        unanswered = 0
        await hint.decided.wait()
        if hint.streaming:  # nothing to ask before the text ends (or a long while passes)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(streaming_look_in()):
                    await _either(hint.text_ended, hint.stream_closed)
        while True:
            if hint.text_ended.is_set() and (done := self._told_end(prompt_id, request_id, hint)):
                return done
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
            streaming = hint.streaming
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(streaming_look_in() if streaming else pause):
                    if streaming:
                        await _either(hint.text_ended, hint.stream_closed)
                    else:
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
