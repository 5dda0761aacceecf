"""Issue 4: one model across N node processes, tokens through the data plane."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from mvp_core import names
from mvp_core.models import (
    ActivationDtype,
    Done,
    Fault,
    RequestShutdown,
    RunOutcome,
    RunPhase,
    SubmitPrompt,
)
from temporal.client import PromptRejected, RunHandle
from tests.helpers.runs import node_output
from tests.integration.conftest import (
    Runs,
    node_pids,
    run_failure,
    snapshot,
    wait_closed,
    wait_phase,
    wait_state,
)
from workers.node.layout import ADDR_NO_RANDOMIZE

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
# Issue 21: with float16 activations the 2-stage text left the 1-stage text within 24
# tokens on these two ("return n * fibonacci(n - 1)" against "return max(fibonacci(n - 1) +").
EXACT_PROMPTS = ["def fibonacci(n):", "Water boils at"]


def _thread_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread's allowed cores, from /proc."""
    out: dict[int, set[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = os.sched_getaffinity(int(task.name))
        except ProcessLookupError:
            pass  # a thread that just ended
    return out


def _no_randomize(pid: int) -> bool:
    return bool(int(Path(f"/proc/{pid}/personality").read_text(), 16) & ADDR_NO_RANDOMIZE)


def _code_at(pid: int, library: str) -> str:
    """Where a library's code is mapped in a process."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1].startswith("r-x") and parts[5].endswith(library):
            return parts[0]
    raise AssertionError(f"{library} not mapped in {pid}")


async def _shutdown(handle, run_id: int) -> RunOutcome:
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
    return RunOutcome.model_validate(await handle.result())


async def _load_order(handle: Any) -> list[tuple[str, int]]:
    """Each node's StageProvision scheduled and its WeightsReady received, in the run's
    history order, by node id."""
    import json as _json

    order: list[tuple[str, int]] = []
    async for e in handle.fetch_history_events():
        sched = e.activity_task_scheduled_event_attributes
        if sched.activity_type.name == names.ACT_NODE_PROVISION_STAGE:
            body = _json.loads(sched.input.payloads[0].data)
            order.append(("provision", int(body["node_id"])))
        signaled = e.workflow_execution_signaled_event_attributes
        if signaled.signal_name == names.SIGNAL_WEIGHTS_READY:
            body = _json.loads(signaled.input.payloads[0].data)
            order.append(("weights_ready", int(body["node_id"])))
    return order


async def test_two_stages_give_the_one_stage_text(runs: Runs):
    pipe = await runs.start(801, pipeline_stages=2)
    ref = await runs.start(802)
    state = await wait_phase(pipe, RunPhase.PROMPT_READY)
    await wait_phase(ref, RunPhase.PROMPT_READY)
    assert [(s.layers.start, s.layers.end) for s in state.plan.stages] == [(0, 15), (15, 30)]
    assert [n.node_id for n in state.nodes] == [2, 3]
    assert [e.edge_id for e in state.plan.edges] == [1, 2, 3]
    act = state.plan.edges[1]  # float32 rows by default (DECISIONS 53)
    assert (act.activation_dtype, act.alignment) == (ActivationDtype.FLOAT32, 4)
    assert state.token_endpoints_ready
    if len(os.sched_getaffinity(0)) > 1:
        # Both nodes' stage threads share the compute cores (all but the first); the
        # rest of each process (event loop, Temporal SDK) runs on the other core(s).
        cores = sorted(os.sched_getaffinity(0))
        compute, rest = set(cores[1:]), set(cores[:1])
        for pid in node_pids(state):
            cpus = _thread_cpus(pid)
            assert compute in cpus.values(), cpus
            assert cpus[pid] == rest, cpus
            assert all(c in (compute, rest) for c in cpus.values()), cpus
    # engine.address_layout "auto": the two co-located nodes run without address-space
    # randomization and have torch's code at the same addresses; the lone node keeps ASLR.
    head, last = node_pids(state)
    assert _no_randomize(head) and _no_randomize(last)
    assert _code_at(head, "libtorch_cpu.so") == _code_at(last, "libtorch_cpu.so")
    assert not _no_randomize(node_pids(await snapshot(ref))[0])
    # Weights load one stage after another, in stage order (actor spec 6.7): stage 1's
    # StageProvision is scheduled only after stage 0's WeightsReady came.
    assert await _load_order(pipe) == [
        ("provision", 2),
        ("weights_ready", 2),
        ("provision", 3),
        ("weights_ready", 3),
    ]
    for i, text in enumerate([*EXACT_PROMPTS, *PROMPTS[:2]]):
        max_tokens = 48 if text in EXACT_PROMPTS else 32
        request = SubmitPrompt(request_id=i, prompt_text=text, max_tokens=max_tokens)
        got = await RunHandle(runs.client, 801).submit(request)
        want = await RunHandle(runs.client, 802).submit(request)
        assert isinstance(got, Done) and isinstance(want, Done)
        assert (got.final_text, got.tokens_generated) == (want.final_text, want.tokens_generated)
        assert got.tokens_generated >= 32 or got.stop_reason == "eos", got
    for handle, rid in ((pipe, 801), (ref, 802)):
        outcome = await _shutdown(handle, rid)
        assert outcome.lifecycle[-1].kind.value == "RunTornDown"


async def test_a_float16_run_gives_the_one_stage_text_with_the_same_fp16_rounding(runs: Runs):
    pipe = await runs.start(803, pipeline_stages=2, activation_dtype="float16")
    ref = await runs.start(804, engine={"fp16_split_points": [15]})
    state = await wait_phase(pipe, RunPhase.PROMPT_READY)
    await wait_phase(ref, RunPhase.PROMPT_READY)
    act = state.plan.edges[1]
    assert (act.activation_dtype, act.alignment, act.max_extent) == (
        ActivationDtype.FLOAT16,
        2,
        state.plan.max_seq_len * 576 * 2,
    )
    for i, text in enumerate(EXACT_PROMPTS):
        request = SubmitPrompt(request_id=i, prompt_text=text, max_tokens=32)
        got = await RunHandle(runs.client, 803).submit(request)
        want = await RunHandle(runs.client, 804).submit(request)
        assert isinstance(got, Done) and isinstance(want, Done)
        assert (got.final_text, got.tokens_generated) == (want.final_text, want.tokens_generated)
    for handle, rid in ((pipe, 803), (ref, 804)):
        outcome = await _shutdown(handle, rid)
        assert outcome.lifecycle[-1].kind.value == "RunTornDown"


@pytest.mark.parametrize(("victim", "name"), [(0, "head"), (1, "middle"), (2, "last")])
async def test_killing_any_stage_node_faults_prompt_and_run_within_15s(
    runs: Runs, victim: int, name: str
):
    run_id = 810 + victim
    handle = await runs.start(
        run_id, pipeline_stages=3, faults={"MVP_FAULT_TEXT_DELAY_MS": "10"}
    )  # the prompt cannot reach EOS before the kill, however fast the machine
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    victim_node = next(n for n in state.nodes if n.stage_index == victim)
    pid = victim_node.handle.pid
    prompt = asyncio.ensure_future(
        RunHandle(runs.client, run_id).submit(
            SubmitPrompt(request_id=1, prompt_text="Once upon a time", max_tokens=2000),
        )
    )
    await wait_state(
        handle, lambda s: 1 in {p.request_id for p in s.actives()}, "prompt 1 generating"
    )
    queued = await RunHandle(runs.client, run_id).start_prompt(
        SubmitPrompt(request_id=2, prompt_text="Hi", max_tokens=4)
    )
    # Pending behind the active one when the node dies.
    await wait_state(handle, lambda s: 2 in {p.request_id for p in s.pending}, "prompt 2 queued")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    result = await asyncio.wait_for(prompt, 20)
    assert isinstance(result, Fault), result
    assert (await asyncio.wait_for(queued.result(), 20)).type == "fault"
    cause = await run_failure(handle)
    elapsed = time.monotonic() - t0
    assert elapsed < 15, f"{name}: {elapsed:.1f}s"
    assert cause.startswith("prompt serving"), cause
    # the first fault names the node that died, not a survivor that saw its edge close
    assert f"node {victim_node.node_id} exited" in cause, cause
    final = await snapshot(handle)
    assert final.torn_down and all(n.provider_stopped for n in final.nodes)


def _hello(edge_id: int, token: bytes, magic: bytes = b"MOH1") -> bytes:
    return struct.pack("<4sIH", magic, edge_id, len(token)) + token


async def test_rogue_peers_are_rejected_and_long_prompts_fault_while_the_run_keeps_serving(
    runs: Runs, state_dir: Path
):
    handle = await runs.start(820, pipeline_stages=2, max_context=64)
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    last = next(n for n in state.nodes if n.stage_index == 1)
    host, _, port = last.runtime_ready.endpoint.rpartition(":")
    for payload in (_hello(2, b"not-the-run-token"), _hello(2, b"x", magic=b"EVIL"), b"\x00" * 7):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(5)
            try:
                while s.recv(1024):
                    pass
            except OSError:
                pass
    log = node_output(last.handle.log_path)
    assert "authentication failed: wrong edge token" in log
    too_long = await RunHandle(runs.client, 820).submit(
        SubmitPrompt(request_id=1, prompt_text="word " * 200)
    )
    assert isinstance(too_long, Fault) and "context" in too_long.error
    ok = await RunHandle(runs.client, 820).submit(
        SubmitPrompt(request_id=2, prompt_text="Hello", max_tokens=4)
    )
    assert isinstance(ok, Done) and ok.tokens_generated >= 1
    assert node_pids(await snapshot(handle)) == node_pids(state)
    await _shutdown(handle, 820)


async def test_token_sequence_violation_inside_a_live_run_faults_it_cleanly(runs: Runs):
    handle = await runs.start(830, pipeline_stages=2, faults={"MVP_FAULT_SKEW_OUT_SEQUENCE": "1"})
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    first = await RunHandle(runs.client, 830).start_prompt(
        SubmitPrompt(request_id=1, prompt_text="Once upon a time", max_tokens=8)
    )
    try:
        queued = await RunHandle(runs.client, 830).start_prompt(
            SubmitPrompt(request_id=2, prompt_text="Hi", max_tokens=4)
        )
    except PromptRejected as err:
        # The first prompt's fault came first (its first token is enough): the run says
        # it is faulting and why (waiting out the fault's grace), or that it is shutting
        # down (the grace is over); a busy CI run got here.
        assert "the run is faulting (" in str(err) or "shutting down" in str(err), err
        queued = None
    result = await first.result()
    assert isinstance(result, Fault)
    if queued is not None:
        # while the fault waits out its grace (no node died), the queued prompt is not
        # started and ends with a Fault when the run faults: exactly one terminal event
        assert (await queued.result()).type == "fault"
    cause = await run_failure(handle)
    assert "sequence violation" in cause, cause
    # The first fault to arrive may be the driver's or a peer stage seeing its edge close;
    # either way the run faults while serving, and the head says exactly what happened.
    assert cause.startswith("prompt serving"), cause
    head = next(n for n in state.nodes if n.stage_index == 0)
    assert "pipeline token sequence violation: expected 1, got 2" in node_output(
        head.handle.log_path
    )
    final = await snapshot(handle)
    assert final.torn_down and all(n.provider_stopped for n in final.nodes)
    await wait_closed(handle)
