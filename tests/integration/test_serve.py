"""Issue 22: a run serves several prompts at once (``max_active_prompts``, DECISIONS 62).

Real runs of the bundled model on local node processes, 1 and 2 stages, 8 prompts active
at once: each prompt's text is its text alone (greedy and seeded), the run shows them
generating side by side, one cancelled mid-stream ends cancelled while the other
seven finish with their texts, and a stage killed under eight ends each with one fault. (The queue behind the active prompts:
tests/workflows/test_run_lifecycle.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus

from mvp_core import names
from mvp_core.models import Done, Fault, RunPhase, ShutdownReason, SubmitPrompt, TextDelta
from temporal.client import RunHandle
from tests.integration.conftest import Runs, run_failure, snapshot, wait_closed, wait_phase

TEXTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Water boils at",
    "The largest planet in our solar system is",
    "In the beginning",
    "Q: What is 12 times 7?\nA:",
    "My favourite colour is",
]
N = 20  # tokens per prompt
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy SmolLM2 counts on and on


def _prompt(rid: int, text: str, seeded: bool) -> SubmitPrompt:
    """Prompt ``text`` (TEXTS[i]: its seed is 1000 + i, whatever its request id)."""
    if not seeded:
        return SubmitPrompt(request_id=rid, prompt_text=text, max_tokens=N)
    return SubmitPrompt(
        request_id=rid,
        prompt_text=text,
        max_tokens=N,
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        seed=1000 + TEXTS.index(text),
    )


@pytest.mark.parametrize("stages", [1, 2])
async def test_eight_prompts_at_once_give_each_prompts_text_alone(runs: Runs, stages: int):
    run_id = 2201 + stages
    handle = await runs.start(
        run_id,
        pipeline_stages=stages,
        max_active_prompts=8,
        prompt_queue_capacity=2,
        max_context=512,
    )
    await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
    run = RunHandle(runs.client, run_id)
    for seeded in (False, True):
        base = 100 if seeded else 0
        alone = [await run.submit(_prompt(base + i, t, seeded)) for i, t in enumerate(TEXTS)]
        before = (await run.snapshot()).most_active
        together = await asyncio.gather(
            *(run.submit(_prompt(base + 50 + i, t, seeded)) for i, t in enumerate(TEXTS))
        )
        for a, b in zip(alone, together, strict=True):
            assert isinstance(a, Done) and isinstance(b, Done), (a, b)
            assert (b.final_text, b.tokens_generated, b.stop_reason) == (
                a.final_text,
                a.tokens_generated,
                a.stop_reason,
            )
        if not seeded:
            # The run's own high-water mark of prompts generating at once (not snapshot
            # polls meanwhile: on a loaded machine none answered while the prompts ran).
            most = (await run.snapshot()).most_active
            assert before == 1 and most >= 2, f"at most {most} prompt(s) active at once"
    assert len({d.final_text for d in together}) == len(TEXTS)  # they differ: it means something
    await run.shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)
    assert await wait_closed(handle) is WorkflowExecutionStatus.COMPLETED


async def test_a_cancel_of_one_of_eight_leaves_the_other_seven(runs: Runs):
    run_id = 2210
    handle = await runs.start(
        run_id, pipeline_stages=2, max_active_prompts=8, prompt_queue_capacity=1, max_context=512
    )
    await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
    run = RunHandle(runs.client, run_id)
    alone = [await run.submit(_prompt(i, t, False)) for i, t in enumerate(TEXTS[1:], 1)]

    victim = SubmitPrompt(request_id=40, prompt_text="1, 2, 3, 4, 5,", max_tokens=400)
    first_text = asyncio.Event()
    ending: list[Done | Fault] = []

    async def follow() -> None:
        async for event in run.stream(victim):
            if isinstance(event, TextDelta):
                first_text.set()
            else:
                ending.append(event)

    streaming = asyncio.ensure_future(follow())
    others = [
        asyncio.ensure_future(run.submit(_prompt(i, t, False))) for i, t in enumerate(TEXTS[1:], 1)
    ]
    await asyncio.wait_for(first_text.wait(), 120)
    await run.cancel_prompt(40)
    await asyncio.wait_for(streaming, 60)
    results = await asyncio.gather(*others)
    assert len(ending) == 1 and isinstance(ending[0], Fault) and ending[0].error == "cancelled"
    # The cancel was pushed to the head node (one stop_generate scheduled), which answered
    # (True: it stopped the generate; False: the heartbeat's answer had stopped it first),
    # or not at all: a stop still pending once the generate has ended is cancelled
    # (DECISIONS 65), as when the heartbeat's answer came first on a busy machine.
    scheduled, answers = await _stop_results(run, 40)
    assert scheduled == 1 and len(answers) <= 1, (scheduled, answers)
    for a, b in zip(alone, results, strict=True):
        assert isinstance(a, Done) and isinstance(b, Done), (a, b)
        assert (b.final_text, b.tokens_generated) == (a.final_text, a.tokens_generated)
    await run.shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)
    assert await wait_closed(handle) is WorkflowExecutionStatus.COMPLETED


async def _stream_all(run: RunHandle, prompt: SubmitPrompt) -> tuple[str, list[Done | Fault]]:
    text, ends = "", []
    async for event in run.stream(prompt):
        if isinstance(event, TextDelta):
            text += event.text
        else:
            ends.append(event)
    return text, ends


async def _stop_results(run: RunHandle, request_id: int) -> tuple[int, list[bool]]:
    """How many node.stop_generate the prompt scheduled, and what each that completed
    returned (True: it stopped a generate)."""
    wf_id = await run.find_prompt(request_id)
    assert wf_id is not None
    handle = run.client.get_workflow_handle(wf_id)
    stops, results = set(), []
    async for e in handle.fetch_history_events():
        scheduled = e.activity_task_scheduled_event_attributes
        if e.HasField("activity_task_scheduled_event_attributes"):
            if scheduled.activity_type.name == names.ACT_NODE_STOP_GENERATE:
                stops.add(e.event_id)
        elif e.HasField("activity_task_completed_event_attributes"):
            done = e.activity_task_completed_event_attributes
            if done.scheduled_event_id in stops:
                payload = done.result.payloads[0]
                results.append(await run.client.data_converter.decode([payload], [bool]))
    return len(stops), [r[0] for r in results]


async def _history_events(run: RunHandle, request_id: int) -> int:
    wf_id = await run.find_prompt(request_id)
    assert wf_id is not None
    return len([e async for e in run.client.get_workflow_handle(wf_id).fetch_history_events()])


async def test_text_comes_from_the_head_node_and_history_does_not_grow_with_length(runs: Runs):
    """DECISIONS 63: a client with the deployment's secret reads a prompt's text from the
    head node; the prompt's history is then a few events whatever its length, and a
    Temporal-only client, a re-attach mid-stream and one after the end still get the
    whole text and one end."""
    run_id = 2220
    handle = await runs.start(run_id, pipeline_stages=2, max_context=1024)
    await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
    run = RunHandle(runs.client, run_id)
    short = SubmitPrompt(request_id=1, prompt_text=COUNTING, max_tokens=32)
    long = SubmitPrompt(request_id=2, prompt_text=COUNTING, max_tokens=512)
    for prompt in (short, long):
        text, ends = await _stream_all(run, prompt)
        assert len(ends) == 1 and isinstance(ends[0], Done), ends
        assert text == ends[0].final_text and ends[0].tokens_generated == prompt.max_tokens
    assert run.direct_streams == 2
    short_events, long_events = await _history_events(run, 1), await _history_events(run, 2)
    # Text made before the client's direct read connects goes through Temporal (so that a
    # Temporal-only client is never starved): on a loaded host that is a few flushes of 4
    # events, however long the prompt (a busy CI run: 12 and 24 events). Growing with the
    # length would be a flush per 100 ms of its 512 tokens: over a hundred events more.
    assert long_events <= short_events + 40, (short_events, long_events)

    # The same long prompt through Temporal alone: the same text, streamed in many flushes.
    temporal_only = RunHandle(runs.client, run_id, direct_text=False)
    again = long.model_copy(update={"request_id": 3})
    text, ends = await _stream_all(temporal_only, again)
    assert isinstance(ends[0], Done) and text == ends[0].final_text
    assert temporal_only.direct_streams == 0
    assert await _history_events(run, 3) > long_events + 40

    # Re-attach mid-stream (from a direct-capable and a Temporal-only client), then after
    # the end: the whole text and one end each time.
    fourth = long.model_copy(update={"request_id": 4, "max_tokens": 200})
    first_text = asyncio.Event()
    owner: list[Any] = []

    async def own() -> None:
        async for event in run.stream(fourth):
            first_text.set()
            owner.append(event)

    owning = asyncio.ensure_future(own())
    await asyncio.wait_for(first_text.wait(), 120)
    for viewer in (RunHandle(runs.client, run_id), temporal_only):
        seen = [e async for e in viewer.attach(4)]
        assert sum(not isinstance(e, TextDelta) for e in seen) == 1
        assert isinstance(seen[-1], Done)
        assert "".join(e.text for e in seen if isinstance(e, TextDelta)) == seen[-1].final_text
    await asyncio.wait_for(owning, 120)
    late = [e async for e in temporal_only.attach(4)]
    assert (
        isinstance(late[-1], Done)
        and "".join(e.text for e in late if isinstance(e, TextDelta)) == late[-1].final_text
    )
    await run.shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)
    assert await wait_closed(handle) is WorkflowExecutionStatus.COMPLETED


@pytest.mark.parametrize("host", ["run", "workflow"])
async def test_sixty_four_streams_at_once_on_a_stock_server_all_generate_together(
    runs: Runs, host: str, tmp_path: Path
):
    """DECISIONS 77: a prompt's admission is the only Update it holds, so a run serves
    every prompt its max_active_prompts admits on a server with Temporal's defaults (this
    suite's dev server sets no dynamic config: history.maxInFlightUpdates is 10). The
    text after each prompt's first piece is held until all 64 are admitted and active
    together (no prompt can end before: were an Update held for each, the eleventh would
    wait for ever). Then each text is its text alone."""
    run_id = 2231 if host == "run" else 2232
    gate = tmp_path / "text-open"
    handle = await runs.start(
        run_id,
        max_active_prompts=64,
        prompt_queue_capacity=1,
        max_context=128,
        prompt_host=host,
        faults={"MVP_FAULT_TEXT_GATE": str(gate)},
    )
    await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
    run = RunHandle(runs.client, run_id)
    texts = TEXTS[:4]
    tokens = 48
    gate.touch()
    alone = [
        await run.submit(SubmitPrompt(request_id=i, prompt_text=t, max_tokens=tokens))
        for i, t in enumerate(texts)
    ]
    gate.unlink()
    admitted = 0
    all_admitted = asyncio.Event()

    def on_admitted() -> None:
        nonlocal admitted
        admitted += 1
        if admitted == 64:
            all_admitted.set()

    async def one(i: int) -> tuple[str, Done | Fault]:
        prompt = SubmitPrompt(request_id=100 + i, prompt_text=texts[i % 4], max_tokens=tokens)
        text = ""
        async for event in run.stream(prompt, on_admitted=on_admitted):
            if isinstance(event, TextDelta):
                text += event.text
            else:
                return text, event
        raise AssertionError("no terminal event")

    streams = asyncio.gather(*(one(i) for i in range(64)))
    try:
        async with asyncio.timeout(180):
            await all_admitted.wait()
            # A run busy admitting 64 may answer a query late: asked again (the bound is
            # the timeout above, not one query's).
            while True:
                state = await run.try_snapshot()
                if state is not None and len(state.actives()) >= 64:
                    break
                assert not streams.done(), streams
                await asyncio.sleep(0.1)
    finally:
        gate.touch()
    results = await streams
    for i, (text, end) in enumerate(results):
        ref = alone[i % 4]
        assert isinstance(end, Done) and isinstance(ref, Done), (i, end, ref)
        assert text == end.final_text == ref.final_text, i
        assert end.tokens_generated == ref.tokens_generated, i
    # The streams had their ends from the head node (DECISIONS 95): the run counts all 64
    # of them now, and may answer a query late meanwhile (asked again).
    async with asyncio.timeout(120):
        while (state := await run.try_snapshot()) is None:
            await asyncio.sleep(0.5)
    assert state.most_active == 64
    await run.shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)
    assert await wait_closed(handle) is WorkflowExecutionStatus.COMPLETED


@pytest.mark.parametrize("killed_stage", [0, 1])
async def test_a_stage_killed_while_eight_generate_ends_each_with_one_fault(
    runs: Runs, killed_stage: int
):
    """Kill the head node (its readers' direct streams break: they fall back to Temporal)
    or the last stage while 8 prompts generate: each of the 8 ends with exactly one fault,
    the run faults as with one prompt, and the fixture finds no node left."""
    cause = await kill_under_eight(
        runs,
        2230 + killed_stage,
        killed_stage,
        pipeline_stages=2,
        max_active_prompts=8,
        prompt_queue_capacity=1,
        max_context=512,
    )
    assert cause.startswith("prompt serving"), cause


async def kill_under_eight(
    runs: Runs, run_id: int, killed_stage: int, *, max_tokens: int = 480, **request: Any
) -> str:
    """Start run ``run_id`` (``request``), stream 8 counting prompts, kill -9 the node of
    ``killed_stage`` while all 8 generate: each ends with exactly one fault, the run
    faults once and is torn down with every node stopped. Returns the run's fault."""
    handle = await runs.start(run_id, **request)
    state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
    run = RunHandle(runs.client, run_id)
    started = [asyncio.Event() for _ in TEXTS]
    seen: list[list[Any]] = [[] for _ in TEXTS]

    async def follow(i: int) -> None:
        # greedy SmolLM2 counts on past any cap here: no prompt can end before the kill,
        # however fast the kernel (some of TEXTS end on their end token)
        prompt = SubmitPrompt(request_id=60 + i, prompt_text=COUNTING, max_tokens=max_tokens)
        async for event in run.stream(prompt):
            if isinstance(event, TextDelta):
                started[i].set()
            seen[i].append(event)

    following = [asyncio.ensure_future(follow(i)) for i in range(len(TEXTS))]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 180)
    assert all(not f.done() for f in following), "a prompt ended before the kill"
    victim = next(n for n in state.nodes if n.stage_index == killed_stage)
    assert victim.handle is not None and victim.handle.pid is not None
    os.kill(victim.handle.pid, signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*following), 120)
    for events in seen:
        ends = [e for e in events if not isinstance(e, TextDelta)]
        assert len(ends) == 1 and isinstance(ends[0], Fault), ends[-3:]
    cause = await run_failure(handle)
    final = await snapshot(handle)
    assert final.torn_down and all(n.provider_stopped for n in final.nodes)
    assert [r.kind.value for r in final.lifecycle].count("RunFaulted") == 1
    return cause
