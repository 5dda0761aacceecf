"""Export representative run histories for the replay test (tests/replay/test_replay.py).

    .venv/bin/python scripts/export_histories.py            # every scenario, ~1-2 min
    .venv/bin/python scripts/export_histories.py --only direct,faulted

Starts its own dev servers (databases in a temp dir; one with a low
``suggestContinueAsNew`` for the continue-as-new scenario) and an orchestrator worker on
each, runs a fixed set of scenarios on real nodes, and writes ``WorkflowHistory.to_json()``
of every RunWorkflow execution (the whole continue-as-new chain: ``run.<k>.json``) and
every PromptWorkflow child (``prompt-<request id>.json``) into
``tests/histories/<scenario>/``, with ``workflows.json`` naming each file's workflow id:
replay needs it (a run derives its run id and its children's ids from it). Nothing is
written unless every scenario ran as expected and no workflow task failed; a scenario's
directory is replaced as a whole.

Re-export after a workflow change that is meant to be incompatible (and therefore
versioned or deployed on a new task queue); a compatible change must replay the old files.
"""

# ruff: noqa: E402  (the repository root goes on sys.path first: tests/ is not installed)
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowHistory,
)
from temporalio.exceptions import ApplicationError

from mvp_core import names
from mvp_core.models import (
    AdmissionAnswers,
    CancelPrompt,
    Done,
    Fault,
    PromptAdmission,
    PromptAdmissions,
    RequestShutdown,
    RunOutcome,
    RunPhase,
    RunRequest,
    SubmitPrompt,
    TextDelta,
)
from temporal.client import PromptRejected, RunHandle
from temporal.connect import TemporalSettings, connect
from temporal.devserver import DevServer, start_dev_server
from tests.helpers.runs import start_run, task_failures
from tests.integration.conftest import (
    OrchestratorProcess,
    harness_env,
    node_pids,
    node_processes,
    snapshot,
    wait_phase,
)

OUT = REPO / "tests" / "histories"
INDEX = "workflows.json"  # file name -> workflow id, per scenario
MODEL = {"bundled": "SmolLM2-135M-Instruct.Q4_1"}
# Each piece of text held this long on a slowed node, so that a kill or a cancel after the
# first delta lands mid-generation whatever the machine. A cancel of the active prompt
# reaches the node with its next heartbeat, which the SDK throttles to 0.8 x the 5 s
# heartbeat timeout: the cancelled prompt gets 64 tokens (16 s), a cancel takes <= ~5 s.
SLOW = {"MVP_FAULT_TEXT_DELAY_MS": "250"}
# The continue-as-new scenario's server: a 1-stage run passes this after startup and a
# few prompts (~60 events at prompt-ready, ~10 per prompt).
CAN_SUGGEST_AT = 100
CAN_PROMPTS = 10


@dataclass
class Ctx:
    """What a scenario needs: a client, and where to put its nodes' fault knobs."""

    client: Client
    faults_file: Path
    state_dir: Path
    handles: list[WorkflowHandle[Any, Any]] = field(default_factory=list)

    async def start(
        self, run_id: int, faults: dict[str, str] | None = None, **request: Any
    ) -> WorkflowHandle[Any, Any]:
        table = json.loads(self.faults_file.read_text())
        table[str(run_id)] = faults or {}
        self.faults_file.write_text(json.dumps(table))
        req = RunRequest.model_validate({"model": MODEL, "default_max_tokens": 8, **request})
        handle = await start_run(self.client, run_id, req)
        self.handles.append(handle)
        return handle


def check(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(f"scenario did not go as planned: {what}")


async def stopped(handle: WorkflowHandle[Any, Any]) -> RunOutcome:
    outcome = RunOutcome.model_validate(await handle.result())
    check(outcome.outcome.value == "operator_stopped", f"outcome {outcome.outcome}")
    return outcome


async def failed(handle: WorkflowHandle[Any, Any], kind: str) -> None:
    try:
        await handle.result()
    except WorkflowFailureError as err:
        cause = err.cause
        check(isinstance(cause, ApplicationError) and cause.type == kind, f"{kind}: {cause}")
        return
    raise RuntimeError(f"scenario did not go as planned: the run did not fail with {kind}")


async def streamed(ctx: Ctx, run_id: int, prompt: SubmitPrompt) -> Done | Fault:
    events = [e async for e in RunHandle(ctx.client, run_id).stream(prompt)]
    terminal = events[-1]
    check(isinstance(terminal, Done | Fault), f"terminal {terminal}")
    assert isinstance(terminal, Done | Fault)
    return terminal


# ---------------------------------------------------------------------- scenarios
async def direct(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """One stage, a submitted and a streamed prompt, operator stop by signal."""
    handle = await ctx.start(3101)
    await wait_phase(handle, RunPhase.PROMPT_READY)
    r1 = await RunHandle(ctx.client, 3101).submit(SubmitPrompt(request_id=1, prompt_text="Hi"))
    r2 = await streamed(ctx, 3101, SubmitPrompt(request_id=2, prompt_text="Once", max_tokens=4))
    check(isinstance(r1, Done) and isinstance(r2, Done), f"{r1} {r2}")
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=3101))
    await stopped(handle)
    return handle


async def two_stages(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """Two stages, two prompts, operator stop by the request_shutdown_and_wait update."""
    handle = await ctx.start(3102, pipeline_stages=2)
    await wait_phase(handle, RunPhase.PROMPT_READY)
    r1 = await RunHandle(ctx.client, 3102).submit(SubmitPrompt(request_id=1, prompt_text="Hi"))
    r2 = await streamed(ctx, 3102, SubmitPrompt(request_id=2, prompt_text="Once", max_tokens=4))
    check(isinstance(r1, Done) and isinstance(r2, Done), f"{r1} {r2}")
    outcome = await handle.execute_update(
        names.UPDATE_SHUTDOWN_AND_WAIT, RequestShutdown(run_id=3102), result_type=RunOutcome
    )
    check(outcome.outcome.value == "operator_stopped", f"update outcome {outcome.outcome}")
    await stopped(handle)
    return handle


async def rejected(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """More stages than the model has layers: RunRejected after planning."""
    handle = await ctx.start(3103, pipeline_stages=31)
    await failed(handle, "RunRejected")
    return handle


async def faulted(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """The node is killed -9 while a slowed prompt generates: RunFaulted, torn down."""
    handle = await ctx.start(3104, faults=SLOW)
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    pid = node_pids(state)[0]
    events = []
    async for ev in RunHandle(ctx.client, 3104).stream(
        SubmitPrompt(request_id=1, prompt_text="Once upon a time")
    ):
        events.append(ev)
        if len(events) == 1:
            check(isinstance(ev, TextDelta), f"first event {ev}")
            os.kill(pid, signal.SIGKILL)
    check(isinstance(events[-1], Fault), f"terminal {events[-1]}")
    await failed(handle, "RunFaulted")
    return handle


async def cancelled(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """One prompt cancelled while active, one while pending; a third completes."""
    handle = await ctx.start(3105, faults=SLOW)
    await wait_phase(handle, RunPhase.PROMPT_READY)
    first_delta = asyncio.Event()

    async def active() -> Done | Fault:
        prompt = SubmitPrompt(request_id=1, prompt_text="Once upon a time", max_tokens=64)
        async for ev in RunHandle(ctx.client, 3105).stream(prompt):
            if isinstance(ev, TextDelta):
                first_delta.set()
            else:
                return ev
        raise RuntimeError("stream ended without a terminal event")

    a = asyncio.ensure_future(active())
    await first_delta.wait()
    b = await RunHandle(ctx.client, 3105).start_prompt(SubmitPrompt(request_id=2, prompt_text="Hi"))
    c = await RunHandle(ctx.client, 3105).start_prompt(
        SubmitPrompt(request_id=3, prompt_text="Hi", max_tokens=2)
    )
    await handle.signal(names.SIGNAL_CANCEL_PROMPT, CancelPrompt(request_id=2))  # pending
    t0 = time.monotonic()
    await handle.signal(names.SIGNAL_CANCEL_PROMPT, CancelPrompt(request_id=1))  # active
    ra = await a
    print(f"  active prompt cancelled in {time.monotonic() - t0:.1f} s", flush=True)
    rb, rc = await b.result(), await c.result()
    check(isinstance(ra, Fault) and "cancelled" in ra.error, f"active {ra}")
    check(isinstance(rb, Fault) and "cancelled" in rb.error, f"pending {rb}")
    check(isinstance(rc, Done), f"third {rc}")
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=3105))
    await stopped(handle)
    return handle


async def malformed(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """Malformed signals are ignored; a request_shutdown with no payload is a stop."""
    handle = await ctx.start(3107)
    await wait_phase(handle, RunPhase.PROMPT_READY)
    await handle.signal(names.SIGNAL_CANCEL_PROMPT)
    await handle.signal(names.SIGNAL_STAGE_FAULT, "hello")
    r = await RunHandle(ctx.client, 3107).submit(
        SubmitPrompt(request_id=1, prompt_text="Hi", max_tokens=4)
    )
    check(isinstance(r, Done), f"prompt {r}")
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
    await stopped(handle)
    state = await snapshot(handle)
    check(state.ignored_reports >= 2, f"ignored {state.ignored_reports}")
    return handle


async def continue_as_new(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """A few prompts across at least one continue-as-new (a low suggest threshold)."""
    handle = await ctx.start(3106)
    await wait_phase(handle, RunPhase.PROMPT_READY)
    for i in range(CAN_PROMPTS):
        prompt = SubmitPrompt(request_id=i, prompt_text="Hi", max_tokens=4)
        while True:
            try:
                r = await RunHandle(ctx.client, 3106).submit(prompt)
                break
            except PromptRejected as err:
                check(err.kind == "RunRollingOver", f"rejection {err.kind}")
                await asyncio.sleep(0.1)
        check(isinstance(r, Done), f"prompt {i}: {r}")
    latest = ctx.client.get_workflow_handle(handle.id)
    state = await snapshot(latest)
    check(state.continued >= 1, f"continued {state.continued}")
    await latest.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=3106))
    await stopped(latest)
    return handle


async def recovered(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """Stage recovery (DECISIONS 68), 3 stages: the middle node killed while 2 prompts
    stream, then the head while one does; each replaced, every prompt Done."""
    run_id = 3107
    handle = await ctx.start(
        run_id,
        faults={"MVP_FAULT_TEXT_DELAY_MS": "20"},
        pipeline_stages=3,
        max_active_prompts=2,
        max_context=256,
        on_node_loss="replace",
    )
    for stage, prompts in ((1, 2), (0, 1)):
        state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=120)
        first = [asyncio.Event() for _ in range(prompts)]

        async def one(rid: int, started: asyncio.Event) -> Done | Fault:
            prompt = SubmitPrompt(request_id=rid, prompt_text="1, 2, 3, 4,", max_tokens=48)
            async for ev in RunHandle(ctx.client, run_id).stream(prompt):
                started.set()
                if not isinstance(ev, TextDelta):
                    return ev
            raise RuntimeError("no terminal event")

        results = [asyncio.ensure_future(one(10 * stage + i, e)) for i, e in enumerate(first)]
        async with asyncio.timeout(120):
            await asyncio.gather(*(e.wait() for e in first))
        victim = next(n for n in state.nodes if n.stage_index == stage)
        check(victim.handle is not None and victim.handle.pid is not None, "victim pid")
        assert victim.handle is not None and victim.handle.pid is not None
        os.kill(victim.handle.pid, signal.SIGKILL)
        for r in await asyncio.gather(*results):
            check(isinstance(r, Done) and r.recoveries == 1, f"stage {stage} loss: {r}")
    state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=120)
    check(state.recoveries_done == 2, f"recoveries {state.recoveries_done}")
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
    await stopped(handle)
    return handle


Scenario = Callable[[Ctx], Awaitable[WorkflowHandle[Any, Any]]]


async def admitted(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """DECISIONS 77: run-hosted prompts admitted by admit_prompt (two at once, one of
    them cancelled mid-stream), beside one by the spec's submit_prompt; stop by signal."""
    run_id = 3108
    handle = await ctx.start(run_id, faults=SLOW, prompt_host="run", max_active_prompts=2)
    await wait_phase(handle, RunPhase.PROMPT_READY)
    run = RunHandle(ctx.client, run_id)
    first_delta = asyncio.Event()

    async def long() -> Done | Fault:
        prompt = SubmitPrompt(request_id=1, prompt_text="Once upon a time", max_tokens=64)
        async for ev in run.stream(prompt):
            if isinstance(ev, TextDelta):
                first_delta.set()
            else:
                return ev
        raise RuntimeError("stream ended without a terminal event")

    a = asyncio.ensure_future(long())
    await first_delta.wait()
    b = await streamed(ctx, run_id, SubmitPrompt(request_id=2, prompt_text="Hi", max_tokens=3))
    await run.cancel_prompt(1)
    ra = await a
    spec = await run.start_prompt(SubmitPrompt(request_id=3, prompt_text="Hi", max_tokens=2))
    rc = await spec.result()
    check(isinstance(ra, Fault) and "cancelled" in ra.error, f"cancelled {ra}")
    check(isinstance(b, Done) and isinstance(rc, Done), f"{b} {rc}")
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
    await stopped(handle)
    return handle


async def admitted_together(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """DECISIONS 106: run-hosted prompts admitted together by one admit_prompts Update,
    one of them refused as a request id in use and one as a full queue; then a batch
    whose every prompt is refused; stop by signal."""
    run_id = 3109
    handle = await ctx.start(
        run_id, prompt_host="run", max_active_prompts=2, prompt_queue_capacity=2
    )
    await wait_phase(handle, RunPhase.PROMPT_READY)

    def item(rid: int, key: str) -> PromptAdmission:
        prompt = SubmitPrompt(request_id=rid, prompt_text="Once upon a time", max_tokens=4)
        return PromptAdmission(prompt=prompt, key=key)

    got = await handle.execute_update(
        names.UPDATE_ADMIT_PROMPTS,
        PromptAdmissions(
            items=[item(1, "a"), item(1, "b"), item(2, "c"), item(3, "d"), item(4, "e")]
        ),
        result_type=AdmissionAnswers,
    )
    check(
        [a.admitted is not None for a in got.answers] == [True, False, True, True, False],
        f"answers {got.answers}",
    )
    run = RunHandle(ctx.client, run_id)
    for a in got.answers:
        if a.admitted is not None:
            end = await run.prompt_end(a.admitted.prompt_id, a.admitted.request_id, hosted=True)
            check(isinstance(end, Done), f"end {end}")
    again = await handle.execute_update(
        names.UPDATE_ADMIT_PROMPTS,
        PromptAdmissions(items=[item(1, "a")]),  # its key names a prompt that ended
        result_type=AdmissionAnswers,
    )
    check(again.answers[0].admitted is None, f"again {again.answers}")
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
    await stopped(handle)
    return handle


MAIN: dict[str, Scenario] = {
    "direct": direct,
    "two_stages": two_stages,
    "rejected": rejected,
    "faulted": faulted,
    "cancelled": cancelled,
    "malformed": malformed,
    "recovered": recovered,
    "admitted": admitted,
    "admitted_together": admitted_together,
}
ROLLING: dict[str, Scenario] = {"continue_as_new": continue_as_new}


# ---------------------------------------------------------------------- export
async def closed(client: Client, wf_id: str, run_id: str, timeout: float = 60.0) -> None:
    handle = client.get_workflow_handle(wf_id, run_id=run_id)
    deadline = time.monotonic() + timeout
    while (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{wf_id} ({run_id}) still running after {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def histories(client: Client, run: WorkflowHandle[Any, Any]) -> dict[str, WorkflowHistory]:
    """Every execution of the run's continue-as-new chain and every prompt child."""
    out: dict[str, WorkflowHistory] = {}
    run_id: str | None = run.first_execution_run_id or run.result_run_id
    k = 0
    while run_id:
        await closed(client, run.id, run_id)
        history = await client.get_workflow_handle(run.id, run_id=run_id).fetch_history()
        out[f"run.{k}.json"] = history
        run_id = None
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED:
                child = event.child_workflow_execution_started_event_attributes.workflow_execution
                await closed(client, child.workflow_id, child.run_id)
                handle = client.get_workflow_handle(child.workflow_id, run_id=child.run_id)
                request_id = child.workflow_id.split("-prompt-")[1].split("-")[0]
                name, n = f"prompt-{request_id}.json", 1
                while name in out:  # a request id used again after its prompt ended
                    name, n = f"prompt-{request_id}.{n}.json", n + 1
                out[name] = await handle.fetch_history()
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
                attrs = event.workflow_execution_continued_as_new_event_attributes
                run_id = attrs.new_execution_run_id
        k += 1
    return out


class Site:
    """A dev server with an orchestrator worker on it, and how to tidy both up."""

    def __init__(self, root: Path, name: str, dynamic_config: dict[str, str] | None) -> None:
        self.dir = root / name
        self.state = self.dir / "state"
        self.state.mkdir(parents=True)
        self.faults = self.dir / "faults.json"
        self.faults.write_text("{}")
        self.server: DevServer = start_dev_server(
            str(self.dir / "t.db"),
            dynamic_config=dynamic_config,
            log_file=str(self.dir / "temporal.log"),
            stop_with_parent=True,
        )
        self.worker = OrchestratorProcess(
            self.server.address, self.state, self.dir, harness_env(self.faults)
        )
        self.ctx: Ctx | None = None

    async def open(self) -> Ctx:
        self.worker.start()
        client = await connect(settings=TemporalSettings.local(self.server.address))
        self.ctx = Ctx(client, self.faults, self.state)
        return self.ctx

    def task_failures(self) -> list[str]:
        """Workflow task failures the worker logged: a history with one shows a bug."""
        return task_failures(self.dir)

    async def close(self) -> None:
        if self.ctx is not None:
            for h in self.ctx.handles:
                try:
                    await self.ctx.client.get_workflow_handle(h.id).terminate("export clean-up")
                except Exception:
                    pass
        for proc in node_processes(self.state):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.worker.stop()
        self.server.stop()


async def export(selected: list[str], out: Path) -> dict[str, dict[str, WorkflowHistory]]:
    result: dict[str, dict[str, WorkflowHistory]] = {}
    with tempfile.TemporaryDirectory(prefix="mvp-export-") as tmp:
        for scenarios, config in (
            (MAIN, None),
            (ROLLING, {"limit.historyCount.suggestContinueAsNew": str(CAN_SUGGEST_AT)}),
        ):
            chosen = [n for n in scenarios if n in selected]
            if not chosen:
                continue
            site = Site(Path(tmp), chosen[0], config)
            try:
                ctx = await site.open()
                for name in chosen:
                    t0 = time.monotonic()
                    handle = await scenarios[name](ctx)
                    result[name] = await histories(ctx.client, handle)
                    print(
                        f"{name:16} {len(result[name]):3} histories "
                        f"{sum(len(h.events) for h in result[name].values()):5} events "
                        f"{time.monotonic() - t0:5.1f} s",
                        flush=True,
                    )
                failures = site.task_failures()
                if failures:
                    raise RuntimeError(f"workflow tasks failed: {failures[:3]}")
            finally:
                await site.close()
    return result


def write(result: dict[str, dict[str, WorkflowHistory]], out: Path) -> None:
    for name, files in result.items():
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for file, history in sorted(files.items()):
            (target / file).write_text(history.to_json() + "\n")
        index = {file: history.workflow_id for file, history in sorted(files.items())}
        (target / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    every = [*MAIN, *ROLLING]
    parser.add_argument("--only", default=",".join(every), help="comma-separated scenarios")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    selected = [s for s in args.only.split(",") if s]
    unknown = set(selected) - set(every)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {every}")
    # The files are committed in plaintext, so the replay test needs no key.
    os.environ.pop("MVP_PAYLOAD_KEY", None)
    t0 = time.monotonic()
    result = asyncio.run(export(selected, args.out))
    write(result, args.out)
    print(f"exported {len(result)} scenario(s) to {args.out} in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
