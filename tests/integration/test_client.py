"""The typed client (temporal/client/) on a real run: a stream owns its prompt.

Defect 11: a Python client that stopped reading a stream (a ``break``, the iterator
dropped, its task cancelled) left its prompt generating: it kept the run's only active
slot, so the next prompt waited for text nobody read.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from mvp_core import names
from mvp_core.models import (
    Done,
    PromptOutcome,
    PromptStatus,
    RunPhase,
    ShutdownReason,
    SubmitPrompt,
    TextDelta,
)
from temporal.client import RunHandle
from tests.helpers.waits import eventually
from tests.integration.conftest import Runs, wait_closed, wait_phase

RUN_ID = 431
# A prompt that generates for minutes on this run (each piece of text held 20 ms): ended
# early only if it is cancelled.
LONG = "Once upon a time"
LONG_TOKENS = 2000
# The next prompt must finish in this time; the abandoned one, uncancelled, holds the run
# for over 40 s (2000 tokens at 20 ms each) before the next one could even start.
NEXT_PROMPT_S = 30.0


@pytest.fixture
async def slow_run(runs: Runs):
    handle = await runs.start(
        RUN_ID, default_max_tokens=64, faults={"MVP_FAULT_TEXT_DELAY_MS": "20"}
    )
    await wait_phase(handle, RunPhase.PROMPT_READY)
    yield RunHandle(runs.client, RUN_ID)
    await RunHandle(runs.client, RUN_ID).request_shutdown(ShutdownReason.OPERATOR_REQUESTED)
    await wait_closed(handle)


async def _break(run: RunHandle, prompt: SubmitPrompt) -> None:
    async for event in RunHandle(run.client, run.run_id).stream(prompt):
        assert isinstance(event, TextDelta)
        break


async def _drop(run: RunHandle, prompt: SubmitPrompt) -> None:
    events = run.stream(prompt)
    assert isinstance(await anext(events), TextDelta)
    del events  # never closed by the caller: garbage
    gc.collect()


async def _cancel(run: RunHandle, prompt: SubmitPrompt) -> None:
    first = asyncio.Event()

    async def read() -> None:
        async for event in run.stream(prompt):
            assert isinstance(event, TextDelta)
            first.set()

    task = asyncio.ensure_future(read())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


Abandon = Callable[[RunHandle, SubmitPrompt], Coroutine[Any, Any, None]]


async def _prompt_outcome(run: RunHandle, request_id: int) -> PromptOutcome:
    # Visibility takes a moment to list a closed prompt.
    wf_id = await eventually(
        lambda: run.find_prompt(request_id),
        timeout=30,
        what=f"prompt {request_id} listed",
        interval=0.1,
    )
    raw = await asyncio.wait_for(run.client.get_workflow_handle(wf_id).result(), NEXT_PROMPT_S)
    return PromptOutcome.model_validate(raw)


@pytest.mark.parametrize("abandon", [_break, _drop, _cancel], ids=["break", "dropped", "cancelled"])
async def test_an_abandoned_stream_cancels_its_prompt_and_frees_the_run(
    slow_run: RunHandle, abandon: Abandon
):
    run = slow_run
    long = SubmitPrompt(request_id=1, prompt_text=LONG, max_tokens=LONG_TOKENS)
    await abandon(run, long)
    # The run is free for the next prompt at once, not after the abandoned one's text.
    nxt = await asyncio.wait_for(
        run.submit(SubmitPrompt(request_id=2, prompt_text="Hi", max_tokens=3)), NEXT_PROMPT_S
    )
    assert isinstance(nxt, Done) and nxt.tokens_generated <= 3
    outcome = await _prompt_outcome(run, 1)
    assert outcome.status is PromptStatus.CANCELLED, outcome
    state = await run.snapshot()
    assert state.active is None and state.pending == []
    # One cancel, for a prompt the run had: none ignored.
    assert [i for i in state.ignored if i.kind == names.SIGNAL_CANCEL_PROMPT] == []


async def test_a_stream_read_to_its_end_cancels_nothing(slow_run: RunHandle):
    run = slow_run
    events = [
        e async for e in run.stream(SubmitPrompt(request_id=3, prompt_text="Hi", max_tokens=4))
    ]
    assert isinstance(events[-1], Done)
    outcome = await _prompt_outcome(run, 3)
    assert outcome.status is PromptStatus.DONE
