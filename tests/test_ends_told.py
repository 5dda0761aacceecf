"""A prompt's end told by its head node's end line (DECISIONS 95): the client takes it
without asking the run, and an admission the run refuses because it has not counted such
an end yet (a full queue, a request id in use) waits until the run has, then is tried
once more. The run here is a stand-in for the Temporal calls the handle makes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from mvp_core.errors import ErrorType
from mvp_core.models import Done, PromptAdmitted, PromptEnd, SubmitPrompt
from temporal.client import RunHandle, ends
from temporal.client.ends import EndHint
from temporal.client.errors import PromptRejected


class Run:
    """admit_prompt refuses with ``refusal`` while the run counts ``counting`` as open;
    prompt_ends says so until it has been asked ``open_for`` times."""

    def __init__(self, refusal: ErrorType, open_for: int) -> None:
        self.refusal, self.open_for = refusal, open_for
        self.admissions = 0
        self.asked = 0

    async def execute_update(self, update: Any, prompt: SubmitPrompt, *, id: str) -> Any:
        self.admissions += 1
        if self.asked < self.open_for:
            raise WorkflowUpdateFailedError(ApplicationError("no", type=self.refusal.value))
        return PromptAdmitted(request_id=prompt.request_id, prompt_id="p-2", hosted=True)

    async def ends(self, ids: list[str]) -> list[PromptEnd | None]:
        self.asked += 1
        return [PromptEnd(prompt_id=i, open=self.asked < self.open_for) for i in ids]


def _handle(run: Run) -> RunHandle:
    handle = RunHandle(client=None, run_id=7, direct_text=False)  # type: ignore[arg-type]
    handle._workflow = run  # type: ignore[assignment]
    handle._ask_ends = run.ends  # type: ignore[method-assign]
    return handle


def _done(request_id: int) -> Done:
    return Done(
        request_id=request_id,
        final_text="4, 5,",
        tokens_generated=2,
        elapsed_ms=9,
        stop_reason="eos",
    )


async def _told(handle: RunHandle, request_id: int) -> Done:
    hint = EndHint()
    hint.terminal = _done(request_id)
    hint.text_ended.set()
    end = await handle.prompt_end("p-1", request_id, hosted=True, hint=hint)
    assert isinstance(end, Done)
    return end


@pytest.mark.parametrize("refusal", [ErrorType.PROMPT_QUEUE_FULL, ErrorType.DUPLICATE_REQUEST_ID])
async def test_a_refusal_waits_for_the_told_end_to_be_counted_then_admits(refusal):
    run = Run(refusal, open_for=3)
    handle = _handle(run)
    assert await _told(handle, 1) == _done(1)
    assert run.asked == 0  # the end came with the text: the run was not asked
    admitted = await handle.admit(SubmitPrompt(request_id=1, prompt_text="1, 2, 3,"))
    assert admitted.prompt_id == "p-2"
    assert run.admissions == 2 and run.asked == 3  # refused, counted, admitted


async def test_a_refusal_with_no_told_end_is_the_callers():
    run = Run(ErrorType.PROMPT_QUEUE_FULL, open_for=3)
    handle = _handle(run)
    with pytest.raises(PromptRejected) as err:
        await handle.admit(SubmitPrompt(request_id=1, prompt_text="1, 2, 3,"))
    assert err.value.kind == ErrorType.PROMPT_QUEUE_FULL.value
    assert run.admissions == 1 and run.asked == 0


async def test_an_end_line_of_another_request_is_not_taken():
    run = Run(ErrorType.PROMPT_QUEUE_FULL, open_for=0)
    handle = _handle(run)
    hint = EndHint()
    hint.terminal = _done(99)  # not this prompt's
    hint.text_ended.set()

    async def kept(ids: list[str]) -> list[PromptEnd | None]:
        run.asked += 1
        return [PromptEnd(prompt_id=i, open=False, terminal=_done(1)) for i in ids]

    handle._ask_ends = kept  # type: ignore[method-assign]
    assert await handle.prompt_end("p-1", 1, hosted=True, hint=hint) == _done(1)
    assert run.asked == 1


async def test_streaming_prompts_look_for_their_ends_together(monkeypatch):
    """Prompts whose text streams from the head look for their ends at the same instants
    of the handle's clock (DECISIONS 101), however their streams started: each look
    joins one query, rather than each prompt asking on its own period."""
    monkeypatch.setattr(ends, "END_POLL_WHILE_STREAMING_S", 0.2)
    run = Run(ErrorType.PROMPT_QUEUE_FULL, open_for=10**6)  # open all along
    handle = _handle(run)
    waits = []
    for i in range(8):
        hint = EndHint(reader=True)
        hint.streaming = True
        hint.decided.set()
        waits.append(asyncio.create_task(handle.prompt_end(f"p-{i}", i, hosted=True, hint=hint)))
        await asyncio.sleep(0.023)  # streams starting at different moments of a period
    await asyncio.sleep(1.0)
    for w in waits:
        w.cancel()
    await asyncio.gather(*waits, return_exceptions=True)
    # ~1.2 s of 0.2 s periods: one query each (each prompt on its own: ~40 looks)
    assert 1 <= run.asked <= 9, run.asked
    assert all(0.1 < ends.streaming_look_in(0.2) <= 0.3 for _ in range(3))
