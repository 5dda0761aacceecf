"""Re-attaching to a prompt (issue 12): a second client, or one that lost its connection,
attaches by run and request id and gets the whole text so far, then the rest, then the one
terminal event; after the end, the whole text and the terminal event."""

from __future__ import annotations

import asyncio

import pytest

from mvp_core import names
from mvp_core.models import Done, RunPhase, SubmitPrompt, TextDelta
from temporal.client import PromptNotFound, RunHandle
from tests.helpers.waits import eventually
from tests.integration.conftest import Runs, wait_phase


async def collect(events: object) -> tuple[str, list[object]]:
    text, terminals = [], []
    async for event in events:  # type: ignore[attr-defined]
        if isinstance(event, TextDelta):
            text.append(event.text)
        else:
            terminals.append(event)
    return "".join(text), terminals


async def test_attaching_mid_generation_and_after_the_end_gives_the_whole_text(runs: Runs):
    run_id = 3601
    # Slow text, so that the second client attaches while the first one is mid-way.
    handle = await runs.start(run_id, faults={"MVP_FAULT_TEXT_DELAY_MS": "40"})
    await wait_phase(handle, RunPhase.PROMPT_READY)
    prompt = SubmitPrompt(request_id=7, prompt_text="Once upon a time", max_tokens=40)
    first_deltas: list[str] = []
    started = asyncio.Event()

    async def original() -> Done:
        terminal = None
        async for event in RunHandle(runs.client, run_id).stream(prompt):
            if isinstance(event, TextDelta):
                first_deltas.append(event.text)
                started.set()
            else:
                terminal = event
        assert isinstance(terminal, Done), terminal
        return terminal

    task = asyncio.ensure_future(original())
    await asyncio.wait_for(started.wait(), 60)
    await eventually(lambda: len(first_deltas) >= 5, timeout=60, what="a few deltas")
    assert not task.done()  # attaching while the text is still being generated
    mid_text, mid_terminals = await collect(RunHandle(runs.client, run_id).attach(7))
    done = await task
    assert 0 < len(first_deltas)
    assert mid_text == done.final_text and "".join(first_deltas) == done.final_text
    assert mid_terminals == [done]

    after_text, after_terminals = await collect(RunHandle(runs.client, run_id).attach(7))
    assert after_text == done.final_text and after_terminals == [done]

    with pytest.raises(PromptNotFound):
        await collect(RunHandle(runs.client, run_id).attach(8))
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
    await handle.result()
    # A closed run's prompts are still there to read.
    closed_text, closed_terminals = await collect(RunHandle(runs.client, run_id).attach(7))
    assert closed_text == done.final_text and closed_terminals == [done]
