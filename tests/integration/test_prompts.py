"""Must-hold 3: one active prompt, FIFO pending, typed rejections, streaming, cancel."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from mvp_core import names
from mvp_core.models import (
    CancelPrompt,
    Done,
    Fault,
    RequestShutdown,
    RunPhase,
    SubmitPrompt,
    TextDelta,
)
from temporal.client import PromptRejected, RunHandle
from temporal.devserver import DevServer
from tests.integration.conftest import Runs, snapshot, wait_closed, wait_phase, wait_state


@pytest.fixture
async def ready_run(runs: Runs):
    handle = await runs.start(401, default_max_tokens=64)
    await wait_phase(handle, RunPhase.PROMPT_READY)
    yield handle
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=401))
    await wait_closed(handle)


async def test_streaming_64_tokens_arrives_in_several_batches_before_the_terminal(
    runs: Runs, slow_run
):
    events = []
    arrivals = []
    async for ev in RunHandle(runs.client, 401).stream(
        SubmitPrompt(request_id=1, prompt_text="Once upon a time", max_tokens=64)
    ):
        events.append(ev)
        arrivals.append(time.perf_counter())
    assert isinstance(events[-1], Done)
    assert all(isinstance(e, TextDelta) for e in events[:-1])
    assert sum(isinstance(e, (Done, Fault)) for e in events) == 1
    done = events[-1]
    assert done.tokens_generated == 64
    assert "".join(e.text for e in events[:-1]) == done.final_text
    # several distinct delivery moments (batches), not one blob at the end
    distinct = {round(t, 2) for t in arrivals[:-1]}
    assert len(distinct) >= 3, distinct


async def test_stream_batch_interval_is_the_runs_choice(runs: Runs):
    """stream_batch_ms=1000: the first delta at once, then about one flush a second (the
    default 100 ms gives a dozen deltas for the same ~1.3 s prompt), on the prompt
    workflow's stream (a client that reads the head node directly gets the text as it
    forms: DECISIONS 63)."""
    handle = await runs.start(
        402,
        stream_batch_ms=1000,
        default_max_tokens=64,
        faults={"MVP_FAULT_TEXT_DELAY_MS": "20"},
    )
    await wait_phase(handle, RunPhase.PROMPT_READY)
    events, arrivals = [], []
    temporal_only = RunHandle(runs.client, 402, direct_text=False)
    async for ev in temporal_only.stream(
        SubmitPrompt(request_id=1, prompt_text="Once upon a time")
    ):
        events.append(ev)
        arrivals.append(time.perf_counter())
    done = events[-1]
    assert isinstance(done, Done) and done.tokens_generated == 64
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == done.final_text
    # Delivery moments: deltas of one batch arrive together (gaps well under 100 ms). At
    # most the first, one a second, and the last, however long the prompt took here (at
    # the default 100 ms it would be about ten a second).
    moments = 1 + sum(b - a > 0.1 for a, b in itertools.pairwise(arrivals[:-1]))
    span = arrivals[-2] - arrivals[0]
    assert 2 <= moments <= 2 + span, [round(t - arrivals[0], 2) for t in arrivals]
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=402))
    await wait_closed(handle)


@pytest.fixture
async def slow_run(runs: Runs):
    """A run whose node holds each piece of text 20 ms, so timing-bound tests do not depend
    on the machine: a long prompt is surely still active when it is cancelled (a fast one
    can reach EOS first), and 64 tokens span several stream batches."""
    handle = await runs.start(401, default_max_tokens=64, faults={"MVP_FAULT_TEXT_DELAY_MS": "20"})
    await wait_phase(handle, RunPhase.PROMPT_READY)
    yield handle
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=401))
    await wait_closed(handle)


async def test_queue_fifo_rejections_and_cancel(runs: Runs, slow_run):
    ready_run = slow_run
    client = runs.client
    long = SubmitPrompt(request_id=10, prompt_text="Once upon a time", max_tokens=2000)
    first = asyncio.ensure_future(RunHandle(client, 401).submit(long))
    await wait_state(
        ready_run, lambda s: 10 in {p.request_id for p in s.actives()}, "prompt 10 generating"
    )
    pending = []
    for i in range(7):
        prompt = SubmitPrompt(request_id=20 + i, prompt_text=f"Number {i}:", max_tokens=2)
        accepted = await RunHandle(client, 401).start_prompt(prompt)
        pending.append(asyncio.ensure_future(accepted.result()))
    queue = [20 + i for i in range(7)]
    state = await wait_state(
        ready_run, lambda s: [p.request_id for p in s.pending] == queue, f"{queue} queued"
    )
    assert state.active is not None and state.active.request_id == 10
    with pytest.raises(PromptRejected) as full:
        await RunHandle(client, 401).submit(SubmitPrompt(request_id=99, prompt_text="x"))
    assert full.value.kind == "PromptQueueFull"
    with pytest.raises(PromptRejected) as dup:
        await RunHandle(client, 401).submit(SubmitPrompt(request_id=21, prompt_text="x"))
    assert dup.value.kind == "DuplicateRequestId"
    # cancel one pending, then the active one
    await ready_run.signal(names.SIGNAL_CANCEL_PROMPT, CancelPrompt(request_id=23))
    await ready_run.signal(names.SIGNAL_CANCEL_PROMPT, CancelPrompt(request_id=10))
    r_first = await first
    assert isinstance(r_first, Fault) and "cancelled" in r_first.error
    # a cancelled prompt's workflow says so: result, search attribute, details
    child = client.get_workflow_handle(_prompt_wf(await snapshot(ready_run), 10))
    desc = await child.describe()
    assert desc.search_attributes.get("MvpPromptStatus") == ["cancelled"]
    assert (await child.result())["status"] == "cancelled"
    results = await asyncio.gather(*pending)
    assert isinstance(results[3], Fault) and results[3].error == "cancelled"
    done = [r for i, r in enumerate(results) if i != 3]
    assert all(isinstance(r, Done) and r.tokens_generated <= 2 for r in done), results
    state = await snapshot(ready_run)
    completions = [r.request_id for r in state.lifecycle if r.kind.value == "PromptCompleted"]
    assert completions == [20, 21, 22, 24, 25, 26]  # FIFO order
    assert state.active is None and state.pending == []
    # the id of an ended prompt may be used again, and the run still serves
    again = await RunHandle(client, 401).submit(
        SubmitPrompt(request_id=10, prompt_text="Hi", max_tokens=3)
    )
    assert isinstance(again, Done)


def _prompt_wf(state, request_id: int) -> str:
    """The prompt workflow id of the latest PromptAccepted report for ``request_id``."""
    return next(
        r.detail
        for r in reversed(state.lifecycle)
        if r.kind.value == "PromptAccepted" and r.request_id == request_id
    )


async def test_max_tokens_absent_uses_the_run_default(runs: Runs, ready_run):
    r = await RunHandle(runs.client, 401).submit(
        SubmitPrompt(request_id=5, prompt_text="Once upon a time")
    )
    assert isinstance(r, Done) and r.tokens_generated == 64 and r.stop_reason == "max_tokens"
    child = runs.client.get_workflow_handle(_prompt_wf(await snapshot(ready_run), 5))
    assert (await child.describe()).search_attributes.get("MvpPromptStatus") == ["done"]


async def test_done_says_the_model_ended_it(runs: Runs, ready_run):
    r = await RunHandle(runs.client, 401).submit(
        SubmitPrompt(request_id=8, prompt_text="Say hi.", chat=True, max_tokens=200),
    )
    assert isinstance(r, Done) and r.stop_reason == "eos" and r.tokens_generated < 200


async def test_prompt_longer_than_context_is_a_prompt_fault_and_run_keeps_serving(
    runs: Runs, ready_run
):
    r = await RunHandle(runs.client, 401).submit(
        SubmitPrompt(request_id=6, prompt_text="word " * 800)
    )
    assert isinstance(r, Fault) and "context" in r.error
    ok = await RunHandle(runs.client, 401).submit(
        SubmitPrompt(request_id=7, prompt_text="Hello", max_tokens=2)
    )
    assert isinstance(ok, Done)


async def test_prompts_are_rejected_before_prompt_ready(runs: Runs):
    handle = await runs.start(402)
    with pytest.raises(PromptRejected) as rej:
        await RunHandle(runs.client, 402).submit(SubmitPrompt(request_id=1, prompt_text="x"))
    assert rej.value.kind == "RunNotPromptReady"
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=402))
    await wait_closed(handle)


async def test_a_one_shot_run_started_with_the_cli_returns_its_text_and_tears_down(
    temporal_server: DevServer, runs: Runs
):
    """Actor spec 8, DECISIONS 83: `temporal workflow execute` of a run with `one_shot`
    serves that prompt once prompt-ready, shuts itself down (reason one_shot_done), and
    its result is the outcome with the prompt's Done: the text, on the command line."""
    import json
    from pathlib import Path

    from tests.integration.conftest import REPO, node_processes
    from tests.integration.test_cli_flow import cli

    request = json.loads(Path(REPO / "docs/examples/run-direct.json").read_text())
    request["one_shot"] = {
        "request_id": 1,
        "prompt_text": "The capital of France is",
        "max_tokens": 16,
    }
    wf = names.run_workflow_id(9)
    runs.handles.append(runs.client.get_workflow_handle(wf))
    out = await asyncio.to_thread(
        cli,
        temporal_server,
        "workflow",
        "execute",
        "--type",
        "RunWorkflow",
        "--task-queue",
        names.ORCHESTRATOR_TASK_QUEUE,
        "--workflow-id",
        wf,
        "--input",
        json.dumps(request),
        "-o",
        "json",
    )
    printed = json.loads(out)
    outcome = printed.get("result", printed)
    assert outcome["outcome"] == "operator_stopped", outcome
    done = outcome["one_shot"]
    assert done["type"] == "done" and done["final_text"].startswith(" Paris."), done
    kinds = [(r["kind"], r.get("detail")) for r in outcome["lifecycle"]]
    assert ("RunOperatorStopped", "one_shot_done") in kinds and kinds[-1][0] == "RunTornDown"
    assert outcome["prompts_completed"] == 1
    assert node_processes(runs.orchestrator.state_dir) == []
