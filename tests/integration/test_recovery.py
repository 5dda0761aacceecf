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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from mvp_core import names
from mvp_core.datastream import decode_payload
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
from mvp_core.run_records import NodeState
from mvp_core.run_state import RunState
from temporal.client import RunHandle
from tests.helpers.waits import eventually
from tests.integration.conftest import (
    Runs,
    run_failure,
    snapshot,
    wait_closed,
    wait_phase,
    wait_state,
)
from workers.host.follow import read_archive

MAX_TOKENS = 160
# Each piece of text held 10 ms on the head node: the kill lands mid-generation.
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


# Each prompt's undisturbed Done, by the prompt less its request id: the text does not
# depend on the stages or the run (float32 edges: the 1-stage text bit for bit), so it is
# computed once per session.
_REFERENCE: dict[str, Done] = {}


def _key(prompt: SubmitPrompt) -> str:
    return prompt.model_copy(update={"request_id": 0}).model_dump_json()


async def _undisturbed(run: RunHandle, prompts: list[SubmitPrompt]) -> list[Done]:
    missing = [p for p in prompts if _key(p) not in _REFERENCE]
    for prompt, done in zip(
        missing, await asyncio.gather(*(run.submit(p) for p in missing)), strict=True
    ):
        assert isinstance(done, Done), done
        _REFERENCE[_key(prompt)] = done
    return [_REFERENCE[_key(p)] for p in prompts]


async def _all_streaming(
    following: list[asyncio.Future[tuple[str, list[Done | Fault]]]],
    started: list[asyncio.Event],
    timeout: float,
) -> None:
    """Until every prompt streams: a stream that ends (or fails) before its first text is
    the test's failure at once, with its cause, not a wait that runs out."""
    waiting = asyncio.ensure_future(asyncio.gather(*(e.wait() for e in started)))
    try:
        done, _ = await asyncio.wait(
            {waiting, *following}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        assert done, f"{sum(e.is_set() for e in started)} of {len(started)} prompts streaming"
        for f in following:
            if f.done():
                raise AssertionError(f"a prompt ended before the kill: {f.result()}")
    finally:
        waiting.cancel()


async def start_replacing(
    runs: Runs, run_id: int, gate: Path | None = None, **request: Any
) -> tuple[WorkflowHandle[object, object], RunHandle]:
    """Run ``run_id`` (3 stages, 4 prompts at once, ``on_node_loss: "replace"`` unless
    ``request`` says otherwise), prompt-ready. ``gate``: a file on this machine (local
    nodes) that each prompt's text after its first piece waits for while it is absent."""
    faults = SLOW_TEXT if gate is None else {**SLOW_TEXT, "MVP_FAULT_TEXT_GATE": str(gate)}
    if gate is not None:
        gate.touch()
    handle = await runs.start(run_id, faults=faults, **_request(**request))
    await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
    return handle, RunHandle(runs.client, run_id)


async def kill_once(
    run: RunHandle,
    handle: WorkflowHandle[object, object],
    killed_stage: int,
    kill: Callable[[NodeState], None] = kill_process,
    prompts: int = 4,
    base: int = 20,
    gate: Path | None = None,
) -> RunState:
    """Stream ``prompts`` prompts and kill ``killed_stage``'s node (``kill``) once all
    stream: each ends Done with its undisturbed text, streamed whole, after one recovery,
    and the run is prompt-ready again on a new node (returned: its state then).

    With the run's text ``gate`` (start_replacing), each prompt's text is held after its
    first piece until the kill, so none can end before it however long the others take to
    start (a loaded machine); without one (nodes that cannot see this machine's files),
    the head's slow text alone keeps them generating."""
    state = await snapshot(handle)
    done_before = state.recoveries_done
    undisturbed = await _undisturbed(run, _prompts(base)[:prompts])
    if gate is not None:
        gate.unlink()
    started = [asyncio.Event() for _ in range(prompts)]
    following = [
        asyncio.ensure_future(_stream(run, p, e))
        for p, e in zip(_prompts(base + 100)[:prompts], started, strict=True)
    ]
    try:
        await _all_streaming(following, started, timeout=240)
        victim = next(n for n in state.nodes if n.stage_index == killed_stage)
        kill(victim)
    finally:
        if gate is not None:
            gate.touch()
    results = await asyncio.wait_for(asyncio.gather(*following), 240)
    for before, (streamed, ends) in zip(undisturbed, results, strict=True):
        assert len(ends) == 1 and isinstance(ends[0], Done), ends
        done = ends[0]
        assert (done.final_text, done.tokens_generated, done.stop_reason) == (
            before.final_text,
            before.tokens_generated,
            before.stop_reason,
        )
        assert streamed == done.final_text  # no gap, no repeat
        assert done.recoveries == 1
    after = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=60)
    n = done_before + 1
    assert after.recoveries_done == n and after.epoch == n and not after.stopping
    rec = after.recoveries[-1]
    assert rec.stage_index == killed_stage and rec.lost_node_id == victim.node_id
    assert rec.ready_at_ms is not None and rec.joined_at_ms is not None
    new = next(x for x in after.nodes if x.stage_index == killed_stage)
    assert new.node_id == rec.new_node_id != victim.node_id
    old = next(x for x in after.replaced_nodes if x.node_id == victim.node_id)
    assert old.provider_stopped and old.exited
    kinds = [r.kind for r in after.lifecycle]
    for kind in (
        LifecycleKind.STAGE_LOST,
        LifecycleKind.STAGE_REPLACING,
        LifecycleKind.STAGE_RECOVERED,
    ):
        assert kinds.count(kind) == n, kinds
    assert LifecycleKind.RUN_FAULTED not in kinds
    return after


async def kill_and_recover(
    runs: Runs,
    run_id: int,
    killed_stage: int,
    kill: Callable[[NodeState], None] = kill_process,
    prompts: int = 4,
    gate: Path | None = None,
    **request: Any,
) -> tuple[RunHandle, RunState]:
    """A run (``request``) that loses ``killed_stage``'s node under ``prompts`` streaming
    prompts and recovers (kill_once; ``gate``: start_replacing's)."""
    handle, run = await start_replacing(runs, run_id, gate, **request)
    return run, await kill_once(run, handle, killed_stage, kill, prompts, gate=gate)


@pytest.mark.parametrize(("prompt_host", "kills"), [("workflow", [1, 0, 2]), ("run", [0, 1])])
async def test_killed_nodes_are_replaced_one_after_another_and_prompts_keep_their_text(
    runs: Runs, prompt_host: str, kills: list[int], tmp_path: Path
):
    """The middle, the head and the last node of 3 killed in turn, 4 prompts streaming
    at each kill, in prompt workflows of their own and served by the run itself
    (DECISIONS 66): each replaced, every prompt Done with its undisturbed text."""
    run_id = 2301 if prompt_host == "workflow" else 2305
    gate = tmp_path / "text-open"
    handle, run = await start_replacing(runs, run_id, gate, prompt_host=prompt_host)
    for i, stage in enumerate(kills):
        direct = run.direct_streams
        await kill_once(run, handle, stage, base=20 + 1000 * i, gate=gate)
        if prompt_host == "run":
            # Each prompt's text was read from the head node to its end: after a head
            # loss, from the replacement head (temporal/client/text.py), not in one piece at
            # the end.
            assert run.direct_streams - direct == 4, run.direct_streams
    # Served on the last pipeline as before.
    prompt = _prompts(30)[0]
    again = await run.submit(prompt)
    assert isinstance(again, Done) and again.recoveries == 0
    assert again.final_text == _REFERENCE[_key(prompt)].final_text
    await run.shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)
    assert await wait_closed(handle) is WorkflowExecutionStatus.COMPLETED
    final = await snapshot(handle)
    assert final.recoveries_done == len(kills) and len(final.replaced_nodes) == len(kills)
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

    def recovered(s: RunState) -> bool:
        assert not s.stopping, s.first_fault
        return s.recoveries_done == 1 and s.phase is RunPhase.PROMPT_READY

    after = await wait_state(handle, recovered, "one recovery, then prompt-ready", timeout=120)
    new = next(n for n in after.nodes if n.stage_index == 1)
    assert new.handle is not None and new.handle.pid is not None
    # The replacement's own datastream is followed too (DECISIONS 93): its load, loaded.
    where = await RunHandle(runs.client, run_id).datastream(wait_s=30)
    assert where is not None

    def replacement_loaded() -> bool:
        return any(
            f["source"] == "node_datastream"
            and f["stream"] == f"mvp-node-{run_id}-{new.node_id}"
            and f["channel"] == "mvp.node.load"
            and decode_payload(f)["status"] == "loaded"
            for f in read_archive(Path(where.archive))
        )

    await eventually(replacement_loaded, timeout=30, what="the replacement's load, loaded")
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
