"""What one prompt costs the control plane, part by part (figures, not a test; issue 22).

A local dev server (SQLite file, as ``mvp-orchestrator`` runs it) and, in this process, a
worker with the real ``PromptWorkflow`` and a head-node stand-in whose generate returns at
once: so the figures are the control plane's own, with no model in the way.

- dev server CPU per prompt workflow (start, its generate activity, its result), and the
  worker process's CPU for the same, with the workflow in the SDK's sandbox and outside it
  (as it runs: DECISIONS 65; for the sandboxed figure the script flips the flag of the
  workflow's definition in this process only)
- dev server CPU per activity heartbeat (an activity heartbeating every 60 ms, throttle
  50 ms, against the same activity heartbeating never)
- a prompt admitted by an Update on a long-lived parent, 8 at once (as the run admits
  them): through a child PromptWorkflow that schedules the generate (the run's way), and
  with the parent scheduling the generate itself; CPU per prompt and wall time per 8

CPU is user+system from /proc, less the server's CPU at rest over the same time.

    .venv/bin/python scripts/bench_control_plane.py [--prompts 40] [--beats 50] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the packages importable
    sys.path.insert(0, str(REPO))

from mvp_core import names  # noqa: E402
from mvp_core.models import (  # noqa: E402
    Done,
    GenerateInput,
    PromptInput,
    PromptOutcome,
    SubmitPrompt,
)
from temporal.connect import connect  # noqa: E402
from temporal.devserver import start_dev_server  # noqa: E402
from workflows.prompt import PromptWorkflow  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
HEAD = "bench-head"
BEAT_EVERY_S = 0.06


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@activity.defn(name=names.ACT_NODE_GENERATE)
async def generate(inp: GenerateInput) -> PromptOutcome:
    text = "x"
    return PromptOutcome(
        terminal=Done(
            request_id=inp.prompt.request_id,
            final_text=text,
            tokens_generated=1,
            elapsed_ms=1,
            stop_reason="eos",
        )
    )


@activity.defn(name="bench.beat")
async def beat(n: int) -> None:
    for _ in range(n):
        activity.heartbeat()
        await asyncio.sleep(BEAT_EVERY_S)


@workflow.defn(name="BenchBeats", sandboxed=False)
class BenchBeats:
    @workflow.run
    async def run(self, n: int) -> None:
        await workflow.execute_activity(
            "bench.beat",
            n,
            task_queue=HEAD,
            start_to_close_timeout=timedelta(minutes=5),
            heartbeat_timeout=timedelta(seconds=5),
        )


def _prompt_input(request_id: int) -> PromptInput:
    """A one-token prompt for the head stand-in, active from its start."""
    return PromptInput(
        run_id=1,
        readiness_id="bench",
        prompt=SubmitPrompt(request_id=request_id, prompt_text="hi"),
        max_new_tokens=1,
        head_task_queue=HEAD,
        head_node_id=1,
        start_active=True,
    )


@workflow.defn(name="BenchAdmit", sandboxed=False)
class BenchAdmit:
    """A parent that admits prompts by Update, as RunWorkflow does: ``child`` starts a
    PromptWorkflow per prompt (the run's way), ``activity`` schedules the generate itself."""

    def __init__(self) -> None:
        self._done = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self._done)

    @workflow.signal
    def finish(self) -> None:
        self._done = True

    @workflow.update
    async def submit(self, mode: str, request_id: int) -> None:
        key = f"{workflow.info().workflow_id}-prompt-{request_id}"
        if mode == "child":
            await workflow.execute_child_workflow(
                PromptWorkflow.run,
                _prompt_input(request_id),
                id=key,
                static_summary=f"prompt {request_id}",
            )
            return
        await workflow.execute_activity(
            names.ACT_NODE_GENERATE,
            GenerateInput(
                run_id=1,
                readiness_id="bench",
                prompt_workflow_id=key,
                prompt=SubmitPrompt(request_id=request_id, prompt_text="hi"),
                max_new_tokens=1,
            ),
            task_queue=HEAD,
            start_to_close_timeout=timedelta(minutes=5),
            heartbeat_timeout=timedelta(seconds=5),
        )


ADMIT_MODES = {
    "child": "admitted by an Update, through a child PromptWorkflow (as the run does)",
    "activity": "admitted by an Update, the parent scheduling the generate itself",
}


async def admissions(client: Client, queue: str, mode: str, count: int) -> tuple[int, float]:
    """``count`` prompts (rounded down to waves of 8, at least one) in waves of 8 Updates
    at once; how many were sent and the mean wall seconds of a wave."""
    handle = await client.start_workflow(
        BenchAdmit.run, id=f"bench-admit-{uuid.uuid4().hex}", task_queue=queue
    )
    waves = max(1, count // 8)
    t0 = time.perf_counter()
    for wave in range(waves):
        await asyncio.gather(
            *(handle.execute_update(BenchAdmit.submit, args=[mode, wave * 8 + i]) for i in range(8))
        )
    took = (time.perf_counter() - t0) / waves
    await handle.signal(BenchAdmit.finish)
    await handle.result()  # closed inside the measured block, not in the next one
    return waves * 8, took


def _sandbox(cls: type, on: bool) -> None:
    """Run ``cls`` in the sandbox or not, whatever its ``@workflow.defn`` says (this
    process only: the SDK keeps the flag on the class's definition)."""
    key = "__temporal_workflow_definition"
    defn = dataclasses.replace(getattr(cls, key), sandboxed=on)
    setattr(cls, key, defn)
    setattr(defn.run_fn, key, defn)


class Meter:
    """CPU of the server and of this process over a block, less the server's rest rate."""

    def __init__(self, server_pid: int, rest_per_s: float) -> None:
        self.pid, self.rest = server_pid, rest_per_s

    async def measure(self, work: asyncio.Future[object] | object) -> tuple[float, float]:
        s0, p0, t0 = _cpu_s(self.pid), time.process_time(), time.perf_counter()
        await work  # type: ignore[misc]
        wall = time.perf_counter() - t0
        server = _cpu_s(self.pid) - s0 - self.rest * wall
        return server, time.process_time() - p0


async def prompts(client: Client, queue: str, count: int) -> None:
    async def one(i: int) -> None:
        handle = await client.start_workflow(
            PromptWorkflow.run,
            _prompt_input(i),
            id=f"bench-prompt-{uuid.uuid4().hex}",
            task_queue=queue,
        )
        await handle.result()

    await asyncio.gather(*(one(i) for i in range(count)))


async def beats(client: Client, queue: str, n: int, count: int) -> None:
    await asyncio.gather(
        *(
            client.execute_workflow(
                BenchBeats.run, n, id=f"bench-beats-{uuid.uuid4().hex}", task_queue=queue
            )
            for _ in range(count)
        )
    )


async def bench(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mvp-bench-cp-"))
    server = start_dev_server(str(tmp / "temporal.db"), log_file=str(tmp / "temporal.log"))
    try:
        client = await connect(server.address)
        pid = server.process.pid
        await asyncio.sleep(2)
        c0 = _cpu_s(pid)
        await asyncio.sleep(5)
        rest = (_cpu_s(pid) - c0) / 5
        meter = Meter(pid, rest)
        print(f"dev server at rest: {rest * 1000:.1f} ms CPU per second")
        runners: list[tuple[str, WorkflowRunner]] = [
            ("in the sandbox", SandboxedWorkflowRunner()),
            ("outside the sandbox", UnsandboxedWorkflowRunner()),
        ]
        per_prompt: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in runners}
        per_beat: list[float] = []
        per_admit: dict[str, list[tuple[float, float, float]]] = {m: [] for m in ADMIT_MODES}
        head = Worker(
            client,
            task_queue=HEAD,
            activities=[generate, beat],
            max_heartbeat_throttle_interval=timedelta(milliseconds=50),
            default_heartbeat_throttle_interval=timedelta(milliseconds=50),
        )
        async with head:
            for _ in range(args.rounds):
                for name, runner in runners:
                    _sandbox(PromptWorkflow, runner is runners[0][1])
                    queue = f"bench-orch-{uuid.uuid4().hex[:8]}"
                    orch = Worker(
                        client,
                        task_queue=queue,
                        workflows=[PromptWorkflow, BenchBeats, BenchAdmit],
                        workflow_runner=runner,
                    )
                    async with orch:
                        await prompts(client, queue, 2)  # warm-up
                        server_s, own_s = await meter.measure(prompts(client, queue, args.prompts))
                        per_prompt[name].append(
                            (server_s * 1000 / args.prompts, own_s * 1000 / args.prompts)
                        )
                        if name == runners[-1][0]:
                            none, _ = await meter.measure(beats(client, queue, 0, 8))
                            some, _ = await meter.measure(beats(client, queue, args.beats, 8))
                            per_beat.append((some - none) * 1000 / (8 * args.beats))
                            for mode in ADMIT_MODES:
                                await admissions(client, queue, mode, 8)  # warm-up
                                run = asyncio.ensure_future(
                                    admissions(client, queue, mode, args.prompts)
                                )
                                server_s, own_s = await meter.measure(run)
                                sent, wave_s = run.result()
                                per_admit[mode].append(
                                    (server_s * 1000 / sent, own_s * 1000 / sent, wave_s * 1000)
                                )
        print(
            f"| part | dev server ms CPU | worker process ms CPU |\n|---|---|---|"
            f"\n| heartbeat (one) | {statistics.median(per_beat):.2f} | - |"
        )
        for name, got in per_prompt.items():
            s = statistics.median(g[0] for g in got)
            w = statistics.median(g[1] for g in got)
            print(f"| prompt workflow {name} (start, generate, result) | {s:.1f} | {w:.1f} |")
        print(
            "\n| a prompt, 8 at once | dev server ms CPU | worker process ms CPU "
            "| wall ms per 8 |\n|---|---|---|---|"
        )
        for mode, got3 in per_admit.items():
            s, w, wall = (statistics.median(g[k] for g in got3) for k in range(3))
            print(f"| {ADMIT_MODES[mode]} | {s:.1f} | {w:.1f} | {wall:.0f} |")
        print(
            f"({args.rounds} round(s), medians; {args.prompts} prompts at once, 8 workflows "
            f"heartbeating {args.beats} times; the worker process also runs the client and "
            "the head stand-in)"
        )
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--beats", type=int, default=50)
    p.add_argument("--rounds", type=int, default=2)
    asyncio.run(bench(p.parse_args()))


if __name__ == "__main__":
    main()
