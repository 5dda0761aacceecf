"""Load on a real dev server with real nodes: several runs at once, and one long run.

(a) Four 1-stage runs on one orchestrator worker, each with a full prompt queue: every
    text must equal what the same prompt gives alone (greedy decode is deterministic),
    every prompt ends exactly once. (b) 240 short prompts through one run that rolls
    over (continue-as-new) every ~33-50 prompts: every run of the chain keeps a bounded
    history, every prompt ends exactly once, and the count carries across the chain.

The figures (prompts/s, history events per prompt, wall time, continue-as-new count, max
events per run) are printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle, WorkflowHistory

from mvp_core import names
from mvp_core.models import Done, RequestShutdown, RunOutcome, RunPhase, SubmitPrompt
from temporal.client import PromptRejected, RunHandle
from temporal.connect import connect
from temporal.devserver import start_dev_server
from tests.helpers.fake_cluster import wait_completed
from tests.helpers.runs import task_failures
from tests.integration.conftest import (
    OrchestratorProcess,
    Runs,
    harness_env,
    node_processes,
    snapshot,
    wait_phase,
)

# The server suggests continue-as-new past this many events: (b) rolls over every
# ~33-50 prompts (one prompt is ~12-18 run events), (a)'s runs (at most ~400 events: 16
# prompts and the startup) never do.
SUGGEST_AT = 600
# A run keeps serving the prompts it admitted before the suggestion (at most IN_FLIGHT
# here), then continues as new; the last run adds its teardown.
HISTORY_BOUND = SUGGEST_AT + 250
IN_FLIGHT = 4
# 180 by default (four or more runs in the chain); MVP_LOAD_PROMPTS sets another count
# (the figures say which).
PROMPTS = int(os.environ.get("MVP_LOAD_PROMPTS", "180"))
TEXTS = [
    "The capital of France is",
    "Once upon a time",
    "The quick brown fox",
    "Water boils at",
    "My favourite colour is",
    "In 1492, Columbus",
    "The best way to learn is",
    "Cats and dogs are",
]


@dataclass
class Site:
    runs: Runs
    state_dir: Path
    log_dir: Path

    def task_failures(self) -> list[str]:
        """Workflow task failures the worker logged (deadlock, nondeterminism, a bug)."""
        return task_failures(self.log_dir)

    @property
    def client(self) -> Client:
        return self.runs.client


@pytest.fixture(scope="module")
async def site(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Site]:
    tmp = tmp_path_factory.mktemp("load")
    srv = start_dev_server(
        str(tmp / "t.db"),
        dynamic_config={"limit.historyCount.suggestContinueAsNew": str(SUGGEST_AT)},
        log_file=str(tmp / "temporal.log"),
    )
    state = tmp / "state"
    state.mkdir()
    faults = tmp / "faults.json"
    faults.write_text("{}")
    worker = OrchestratorProcess(srv.address, state, tmp, harness_env(faults))
    runs: Runs | None = None
    try:
        worker.start()
        runs = Runs(await connect(srv.address), worker, faults)
        yield Site(runs, state, tmp)
    finally:
        for h in runs.handles if runs else []:
            try:
                await h.terminate("clean-up")  # the handle follows the chain to its latest run
            except Exception:
                pass
        leaked = node_processes(state)
        for proc in leaked:
            proc.kill()
        worker.stop()
        srv.stop()
        assert not leaked, [p.pid for p in leaked]


async def chain(client: Client, handle: WorkflowHandle[Any, Any]) -> list[WorkflowHistory]:
    """The histories of every run of the continue-as-new chain that ``handle`` started."""
    out = []
    run_id: str | None = handle.first_execution_run_id or handle.result_run_id
    while run_id:
        history = await client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
        out.append(history)
        run_id = next(
            (
                e.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
                for e in history.events
                if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
            ),
            None,
        )
    return out


def prompt_children(history: WorkflowHistory) -> list[int]:
    """Request ids of the prompt workflows the run saw complete (one entry each)."""
    started = {}
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
            a = e.start_child_workflow_execution_initiated_event_attributes
            started[e.event_id] = int(a.workflow_id.split("-prompt-")[1].split("-")[0])
    return [
        started[e.child_workflow_execution_completed_event_attributes.initiated_event_id]
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED
    ]


async def stop(handle: WorkflowHandle[Any, Any], run_id: int) -> RunOutcome:
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
    outcome = RunOutcome.model_validate(await handle.result())
    assert outcome.outcome.value == "operator_stopped", outcome
    assert [r.kind.value for r in outcome.lifecycle].count("RunTornDown") == 1
    return outcome


@pytest.mark.timeout(300)
async def test_four_runs_at_once_with_full_queues_give_the_reference_texts(site: Site) -> None:
    client, ids = site.client, [1701, 1702, 1703, 1704]
    handles = [await site.runs.start(i, default_max_tokens=8) for i in ids]
    await asyncio.gather(*(wait_phase(h, RunPhase.PROMPT_READY, timeout=180) for h in handles))
    reference = {}
    t_ref = time.monotonic()
    for i, text in enumerate(TEXTS):  # one prompt at a time, on one run: the reference
        r = await RunHandle(client, ids[0]).submit(
            SubmitPrompt(request_id=100 + i, prompt_text=text)
        )
        assert isinstance(r, Done), r
        reference[text] = r.final_text
    t_ref = time.monotonic() - t_ref
    before = [len((await h.fetch_history()).events) for h in handles]

    async def fill(run_id: int) -> list[Any]:
        accepted = [
            await RunHandle(client, run_id).start_prompt(
                SubmitPrompt(request_id=i, prompt_text=text)
            )
            for i, text in enumerate(TEXTS)
        ]
        return list(await asyncio.gather(*(a.result() for a in accepted)))

    t0 = time.monotonic()
    results = await asyncio.gather(*(fill(i) for i in ids))
    elapsed = time.monotonic() - t0
    for run_id, texts in zip(ids, results, strict=True):
        for i, r in enumerate(texts):
            assert isinstance(r, Done), (run_id, i, r)
            assert r.request_id == i and r.final_text == reference[TEXTS[i]], (run_id, i, r)
    after = [len((await h.fetch_history()).events) for h in handles]
    for run_id, h in zip(ids, handles, strict=True):
        state = await snapshot(h)
        completed = collections.Counter(
            r.request_id for r in state.lifecycle if r.kind.value == "PromptCompleted"
        )
        assert all(completed[i] == 1 for i in range(len(TEXTS))), (run_id, completed)
        assert state.prompts_faulted == 0 and state.continued == 0, state
    outcomes = [await stop(h, i) for h, i in zip(handles, ids, strict=True)]
    assert not site.task_failures(), site.task_failures()[:3]
    assert [o.prompts_completed for o in outcomes] == [16, 8, 8, 8]
    totals = [len((await h.fetch_history()).events) for h in handles]
    n = len(ids) * len(TEXTS)
    per_prompt = [(a - b) / len(TEXTS) for a, b in zip(after, before, strict=True)]
    print(
        f"\nLOAD(a) {n} prompts on {len(ids)} runs in {elapsed:.1f} s: {n / elapsed:.1f} prompts/s;"
        f" run history events per prompt {sum(per_prompt) / len(per_prompt):.1f}"
        f" (serving only), {sum(totals[1:]) / (3 * len(TEXTS)):.1f} (whole run incl."
        f" startup and teardown, runs of {len(TEXTS)} prompts); one run alone, one prompt"
        f" at a time: {len(TEXTS) / t_ref:.1f} prompts/s"
    )


@pytest.mark.timeout(900)
async def test_hundreds_of_prompts_across_continue_as_new_keep_history_bounded(site: Site) -> None:
    client, run_id = site.client, 1800
    handle = await site.runs.start(run_id, default_max_tokens=1)
    await wait_phase(handle, RunPhase.PROMPT_READY, timeout=120)
    terminals: collections.Counter[int] = collections.Counter()
    next_id = iter(range(PROMPTS))
    refusals = collections.Counter[str]()

    async def client_loop() -> None:
        for request_id in next_id:
            prompt = SubmitPrompt(request_id=request_id, prompt_text="Hi", max_tokens=1)
            while True:
                try:
                    r = await RunHandle(client, run_id).submit(prompt)
                    break
                except PromptRejected as err:
                    assert err.kind == "RunRollingOver", err
                    refusals[err.kind] += 1
                    await asyncio.sleep(0.05)
            assert isinstance(r, Done) and r.request_id == request_id, r
            terminals[request_id] += 1

    t0 = time.monotonic()
    await asyncio.gather(*(client_loop() for _ in range(IN_FLIGHT)))
    elapsed = time.monotonic() - t0
    assert sorted(terminals) == list(range(PROMPTS))
    assert set(terminals.values()) == {1}
    latest = client.get_workflow_handle(handle.id)
    state = await wait_completed(latest, PROMPTS)
    assert state.prompts_completed == PROMPTS and state.prompts_faulted == 0, state
    assert state.continued >= max(1, PROMPTS // 60), state.continued  # one per 33-50
    await stop(latest, run_id)
    assert not site.task_failures(), site.task_failures()[:3]
    histories = await chain(client, handle)
    # The snapshot above may be taken with a rollover under way (phase rolling_over): the
    # chain then holds one run more than it counted.
    assert len(histories) - 1 in (state.continued, state.continued + 1), (len(histories), state)
    sizes = [len(h.events) for h in histories]
    assert max(sizes) <= HISTORY_BOUND, sizes
    served = collections.Counter(rid for h in histories for rid in prompt_children(h))
    assert sorted(served) == list(range(PROMPTS)) and set(served.values()) == {1}
    print(
        f"\nLOAD(b) {PROMPTS} prompts (max_tokens 1, {IN_FLIGHT} in flight) in {elapsed:.1f} s:"
        f" {PROMPTS / elapsed:.1f} prompts/s, {elapsed / PROMPTS * 1000:.0f} ms/prompt;"
        f" continue-as-new x{state.continued}; events per run {sizes} (max {max(sizes)},"
        f" bound {HISTORY_BOUND}); {sum(sizes) / PROMPTS:.1f} events per prompt;"
        f" {sum(refusals.values())} RunRollingOver refusals retried"
    )
