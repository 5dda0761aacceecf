"""Issue 23: stage recovery (``on_node_loss: "replace"``, DECISIONS 68).

Real runs of the bundled model on local node processes, 3 stages, 4 prompts generating at
once: a stage's node killed with kill -9 mid-generation is replaced through the provider,
the pipeline is wired anew (the survivors keep their weights) and every prompt completes
with exactly the text of an undisturbed run, streamed without a gap or a repeat, with one
terminal event each; the run is prompt-ready again, the old node never rejoins and the
fixture finds no node left. A loss past the bound faults the run as fail-stop does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus

from mvp_core import names
from mvp_core.models import (
    Done,
    Fault,
    LifecycleKind,
    RunOutcome,
    RunPhase,
    ShutdownReason,
    SubmitPrompt,
    TextDelta,
)
from mvp_core.run_state import NodeState, RunState
from temporal.client import RunHandle
from tests.integration.conftest import Runs, run_failure, snapshot, wait_closed, wait_phase

MAX_TOKENS = 160
# Each piece of text held 10 ms on the head node: no prompt can end before the kill,
# however fast the machine.
SLOW_TEXT = {"MVP_FAULT_TEXT_DELAY_MS": "10"}


def _prompts(base: int) -> list[SubmitPrompt]:
    """Two greedy prompts and two seeded sampled ones, each counting on past any cap here
    (SmolLM2 keeps counting, sampled too): every prompt is in flight at the kill."""
    greedy = [
        SubmitPrompt(request_id=base + i, prompt_text=text, max_tokens=MAX_TOKENS)
        for i, text in enumerate(["1, 2, 3, 4, 5,", "100, 101, 102, 103,"])
    ]
    sampled = [
        SubmitPrompt(
            request_id=base + 2 + i,
            prompt_text=text,
            max_tokens=MAX_TOKENS,
            temperature=0.8,
            top_k=40,
            top_p=0.95,
            seed=7 + i,
        )
        for i, text in enumerate(["2, 4, 6, 8, 10,", "10, 20, 30, 40,"])
    ]
    return greedy + sampled


def _request(**extra: Any) -> dict[str, Any]:
    return {
        "pipeline_stages": 3,
        "max_active_prompts": 4,
        "prompt_queue_capacity": 2,
        "max_context": 512,
        "on_node_loss": "replace",
        **extra,
    }


async def _stream(
    run: RunHandle, prompt: SubmitPrompt, started: asyncio.Event
) -> tuple[str, list[Done | Fault]]:
    text, ends = "", []
    async for event in run.stream(prompt):
        if isinstance(event, TextDelta):
            text += event.text
            started.set()
        else:
            ends.append(event)
    return text, ends


def kill_process(node: NodeState) -> None:
    assert node.handle is not None and node.handle.pid is not None
    os.kill(node.handle.pid, signal.SIGKILL)


async def kill_and_recover(
    runs: Runs,
    run_id: int,
    killed_stage: int,
    kill: Callable[[NodeState], None] = kill_process,
    prompts: int = 4,
    **request: Any,
) -> tuple[RunHandle, RunState, float]:
    """Serve ``prompts`` prompts undisturbed, then the same again with ``killed_stage``'s
    node killed (``kill``) once all stream: each ends Done with the undisturbed text,
    streamed whole, and the run is prompt-ready again on a new node."""
    handle = await runs.start(run_id, faults=SLOW_TEXT, **_request(**request))
    state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
    run = RunHandle(runs.client, run_id)
    undisturbed = await asyncio.gather(*(run.submit(p) for p in _prompts(10)[:prompts]))
    assert all(isinstance(d, Done) for d in undisturbed), undisturbed

    started = [asyncio.Event() for _ in range(prompts)]
    following = [
        asyncio.ensure_future(_stream(run, p, e))
        for p, e in zip(_prompts(20)[:prompts], started, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 180)
    assert all(not f.done() for f in following), "a prompt ended before the kill"
    victim = next(n for n in state.nodes if n.stage_index == killed_stage)
    kill(victim)
    killed_at = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*following), 240)
    for before, (streamed, ends) in zip(undisturbed, results, strict=True):
        assert len(ends) == 1 and isinstance(ends[0], Done), ends
        done = ends[0]
        assert isinstance(before, Done)
        assert (done.final_text, done.tokens_generated, done.stop_reason) == (
            before.final_text,
            before.tokens_generated,
            before.stop_reason,
        )
        assert streamed == done.final_text  # no gap, no repeat
        assert done.recoveries == 1
    after = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=60)
    assert after.recoveries_done == 1 and after.epoch == 1 and not after.stopping
    rec = after.recoveries[-1]
    assert rec.stage_index == killed_stage and rec.lost_node_id == victim.node_id
    assert rec.ready_at_ms is not None and rec.joined_at_ms is not None
    new = next(n for n in after.nodes if n.stage_index == killed_stage)
    assert new.node_id == rec.new_node_id != victim.node_id
    old = next(n for n in after.replaced_nodes if n.node_id == victim.node_id)
    assert old.provider_stopped and old.exited
    kinds = [r.kind for r in after.lifecycle]
    for kind in (
        LifecycleKind.STAGE_LOST,
        LifecycleKind.STAGE_REPLACING,
        LifecycleKind.STAGE_RECOVERED,
    ):
        assert kinds.count(kind) == 1, kinds
    assert LifecycleKind.RUN_FAULTED not in kinds
    return run, after, killed_at


@pytest.mark.parametrize(
    ("killed_stage", "prompt_host"),
    [(0, "workflow"), (1, "workflow"), (2, "workflow"), (0, "run"), (1, "run")],
)
async def test_a_killed_stage_is_replaced_and_every_prompt_ends_with_its_text(
    runs: Runs, killed_stage: int, prompt_host: str
):
    """Head, middle and last node of 3, with prompts in workflows of their own and
    served by the run itself (DECISIONS 66)."""
    run_id = 2301 + killed_stage + (5 if prompt_host == "run" else 0)
    run, _, _ = await kill_and_recover(runs, run_id, killed_stage, prompt_host=prompt_host)
    # Served on the new pipeline as before, and a queue kept through it.
    again = await run.submit(_prompts(30)[0])
    assert isinstance(again, Done) and again.recoveries == 0
    await run.shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)
    handle = runs.handles[-1]
    assert await wait_closed(handle) is WorkflowExecutionStatus.COMPLETED
    final = await snapshot(handle)
    assert all(n.provider_stopped for n in (*final.nodes, *final.replaced_nodes))


async def test_a_loss_past_the_bound_faults_the_run(runs: Runs):
    """One replacement allowed: the second loss is the run's fault, as fail-stop."""
    run_id = 2310
    handle = await runs.start(
        run_id, **_request(pipeline_stages=2, recovery={"max_replacements": 1})
    )
    state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
    victim = next(n for n in state.nodes if n.stage_index == 1)
    assert victim.handle is not None and victim.handle.pid is not None
    os.kill(victim.handle.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        after = await snapshot(handle)
        if after.recoveries_done == 1 and after.phase is RunPhase.PROMPT_READY:
            break
        assert time.monotonic() < deadline and not after.stopping, after.first_fault
        await asyncio.sleep(0.2)
    new = next(n for n in after.nodes if n.stage_index == 1)
    assert new.handle is not None and new.handle.pid is not None
    os.kill(new.handle.pid, signal.SIGKILL)
    cause = await run_failure(handle)
    assert f"node {new.node_id} exited" in cause and "no replacement left" in cause, cause
    final = await snapshot(handle)
    assert final.torn_down
    assert all(n.provider_stopped for n in (*final.nodes, *final.replaced_nodes))


async def test_a_replacement_that_fails_faults_the_run_cleanly(runs: Runs):
    """The replacement node dies before it is ready: the run faults as fail-stop does,
    naming it, and stops every node, the lost one and both replacements' included."""
    run_id = 2311
    handle = await runs.start(run_id, **_request(pipeline_stages=2))
    state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
    runs.set_faults(run_id, {"MVP_FAULT_EXIT_BEFORE_READY": "1"})  # nodes started from now
    victim = next(n for n in state.nodes if n.stage_index == 1)
    assert victim.handle is not None and victim.handle.pid is not None
    os.kill(victim.handle.pid, signal.SIGKILL)
    cause = await run_failure(handle)
    assert "while stage 1 was being replaced" in cause or "recovery of stage 1" in cause, cause
    final = await snapshot(handle)
    assert final.torn_down and final.recoveries_done == 0
    assert all(n.provider_stopped for n in (*final.nodes, *final.replaced_nodes))
    kinds = [r.kind for r in final.lifecycle]
    assert (
        LifecycleKind.STAGE_RECOVERED not in kinds and kinds.count(LifecycleKind.RUN_FAULTED) == 1
    )


async def test_a_node_lost_while_the_run_stops_is_not_replaced(runs: Runs):
    run_id = 2312
    handle = await runs.start(run_id, **_request(pipeline_stages=2, timeouts={"stop_grace_s": 1}))
    state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
    victim = next(n for n in state.nodes if n.stage_index == 1)
    assert victim.handle is not None and victim.handle.pid is not None
    os.kill(victim.handle.pid, signal.SIGKILL)
    outcome = RunOutcome.model_validate(await handle.result())
    assert outcome.outcome.value == "operator_stopped" and outcome.first_fault is None, outcome
    kinds = [r.kind for r in outcome.lifecycle]
    assert LifecycleKind.STAGE_LOST not in kinds and LifecycleKind.STAGE_REPLACING not in kinds
    final = await snapshot(handle)
    assert len(final.nodes) == 2 and not final.replaced_nodes
