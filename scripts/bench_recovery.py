"""Stage recovery benchmark (figures, not a test; issue 23, DECISIONS 68).

A local dev server, an orchestrator worker and one run per ``--stages`` value with
``on_node_loss: "replace"`` and ``--prompts`` prompts generating at once. For each
killed stage (``--kill``, default every stage), the same greedy prompts are first served
undisturbed, then again with that stage's node killed (``kill -9`` of its process, or
``docker kill`` of its container with ``--provider docker``) once every prompt streams.
Each trial reports, from the run's own record of the recovery (workflow time, this
host's clock) and the client's arrival times:

- detection: the kill -> the run learnt of the loss (StageLost)
- provisioning: the loss -> the replacement passed the readiness barrier (stop of the
  lost node, provider start, runtime ready, lease, route, ack)
- load + wiring: -> prompt-ready again (the replacement's weights, every stage's new edges)
- resume: -> the prompts' first text after the pause (the tokens re-fed, or for a lost
  head, the regenerated ones since the checkpoint)
- pause: the longest gap between two text deltas of a prompt, the median over prompts
- tokens lost and text equality: each prompt's final text against its undisturbed text

    .venv/bin/python scripts/bench_recovery.py [--stages 2 3] [--kill 0 1 2]
        [--prompts 4] [--tokens 256] [--provider process|docker] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mvp_core import names
from mvp_core.models import (
    Done,
    RequestShutdown,
    RunPhase,
    RunRequest,
    SubmitPrompt,
    TextDelta,
)
from mvp_core.run_records import NodeState
from mvp_core.run_state import RunState
from mvp_io.model_store import DEFAULT_BUNDLED, fetch_bundled
from scripts.bench_gateway import _wait_for
from temporal.client import RunHandle
from temporal.connect import connect
from temporal.devserver import start_dev_server
from workers.host.embedded import start_worker, stop_process

RUN_ID = 9300
COUNTS = ["1, 2, 3, 4,", "100, 101, 102,", "2, 4, 6, 8,", "10, 20, 30,", "5, 10, 15,"]


@dataclass
class Trial:
    provider: str
    stages: int
    killed_stage: int
    prompts: int
    detection_s: float | None = None
    provisioning_s: float | None = None
    load_s: float | None = None
    resume_s: float | None = None
    kill_to_text_s: float | None = None
    pause_p50_s: float | None = None
    tokens_lost: int = 0
    same_text: bool = False
    recoveries: list[int] = field(default_factory=list)
    error: str | None = None


def _prompts(base: int, n: int, tokens: int) -> list[SubmitPrompt]:
    return [
        SubmitPrompt(request_id=base + i, prompt_text=COUNTS[i % len(COUNTS)], max_tokens=tokens)
        for i in range(n)
    ]


async def _stream(run: RunHandle, prompt: SubmitPrompt) -> tuple[list[float], Done | None]:
    """Arrival times of the prompt's text deltas, and its Done (None: it did not end so)."""
    times: list[float] = []
    end: Done | None = None
    async for event in run.stream(prompt):
        if isinstance(event, TextDelta):
            times.append(time.time())
        elif isinstance(event, Done):
            end = event
    return times, end


def _kill(node: NodeState, provider: str) -> None:
    assert node.handle is not None
    if provider == "docker":
        import docker

        client = docker.from_env()
        client.containers.get(node.handle.container_id or node.handle.resource_name).kill()
        client.close()
        return
    assert node.handle.pid is not None
    os.kill(node.handle.pid, signal.SIGKILL)


async def _ready(run: RunHandle, recoveries: int = 0) -> RunState:
    while True:
        state = await run.snapshot()
        if state.phase is RunPhase.PROMPT_READY and state.recoveries_done >= recoveries:
            return state
        if state.stopping:
            raise RuntimeError(f"the run stopped: {state.first_fault}")
        await asyncio.sleep(0.1)


async def trial(run: RunHandle, args: argparse.Namespace, stages: int, kill: int) -> Trial:
    t = Trial(args.provider, stages, kill, args.prompts)
    state = await _ready(run)
    base = 1000 * (kill + 1)
    alone = await asyncio.gather(
        *(run.submit(p) for p in _prompts(base, args.prompts, args.tokens))
    )
    streams = [
        asyncio.ensure_future(_stream(run, p))
        for p in _prompts(base + 100, args.prompts, args.tokens)
    ]
    await asyncio.sleep(args.kill_after)
    victim = next(n for n in state.nodes if n.stage_index == kill)
    killed_at = time.time()
    _kill(victim, args.provider)
    results = await asyncio.gather(*streams)
    after = await _ready(run, state.recoveries_done + 1)
    rec = after.recoveries[-1]
    if rec.joined_at_ms is None or rec.ready_at_ms is None:
        t.error = "the recovery has no times"
        return t
    lost_at, joined, ready = rec.lost_at_ms / 1000, rec.joined_at_ms / 1000, rec.ready_at_ms / 1000
    t.detection_s = round(lost_at - killed_at, 3)
    t.provisioning_s = round(joined - lost_at, 3)
    t.load_s = round(ready - joined, 3)
    firsts, pauses = [], []
    t.same_text = True
    for before, (times, done) in zip(alone, results, strict=True):
        if done is None or not isinstance(before, Done):
            t.same_text = False
            continue
        t.recoveries.append(done.recoveries)
        t.same_text &= done.final_text == before.final_text
        t.tokens_lost += max(0, before.tokens_generated - done.tokens_generated)
        later = [x for x in times if x > killed_at]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        if gaps:
            pauses.append(max(gaps))
        if later:
            # The first text after the pause: the delta that ends the longest gap.
            i = max(range(1, len(times)), key=lambda k: times[k] - times[k - 1])
            firsts.append(times[i])
    if firsts:
        first = statistics.median(firsts)
        t.resume_s = round(first - ready, 3)
        t.kill_to_text_s = round(first - killed_at, 3)
    if pauses:
        t.pause_p50_s = round(statistics.median(pauses), 3)
    return t


async def bench_run(args: argparse.Namespace, stages: int, tmp: Path) -> list[Trial]:
    docker = args.provider == "docker"
    server = start_dev_server(
        str(tmp / f"t{stages}.db"),
        log_file=str(tmp / "temporal.log"),
        ip="0.0.0.0" if docker else "127.0.0.1",
    )
    log = tmp / f"orchestrator-{stages}.log"
    worker = start_worker(server.address, tmp, log, {names.REAPER_INTERVAL_ENV: "0"})
    run_id = RUN_ID + stages
    handle = None
    out: list[Trial] = []
    try:
        await asyncio.to_thread(_wait_for, log, "worker ready", worker, 60)
        client = await connect(server.address)
        request = RunRequest.model_validate(
            {
                "model": {"bundled": DEFAULT_BUNDLED},
                "pipeline_stages": stages,
                "max_active_prompts": args.prompts,
                "prompt_queue_capacity": 4,
                "max_context": 512,
                "provider": args.provider,
                "docker": {"cpus": args.cpus} if docker and args.cpus else {},
                "on_node_loss": "replace",
                "recovery": {"max_replacements": 100},
            }
        )
        handle = (await RunHandle.start(client, run_id, request)).workflow
        run = RunHandle(client, run_id)
        await _ready(run)
        for kill in args.kill:
            if kill >= stages:
                continue
            try:
                got = await trial(run, args, stages, kill)
            except Exception as err:
                got = Trial(args.provider, stages, kill, args.prompts, error=repr(err))
            print(json.dumps(asdict(got)), file=sys.stderr, flush=True)
            out.append(got)
            if got.error is not None:
                break
        return out
    finally:
        if handle is not None:
            with contextlib.suppress(Exception):
                await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
                async with asyncio.timeout(60):
                    await handle.result()
        stop_process(worker, 15)
        server.stop()


def _which(t: Trial) -> str:
    if t.killed_stage == 0:
        return "head (0)"
    if t.killed_stage == t.stages - 1:
        return f"last ({t.killed_stage})"
    return f"middle ({t.killed_stage})"


def table(trials: list[Trial]) -> str:
    head = (
        "| provider | stages | killed | detection s | provisioning s | load + wiring s | "
        "resume s | kill -> text s | pause p50 s | tokens lost | same text |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {t.provider} | {t.stages} | {_which(t)} "
        f"| {t.detection_s} | {t.provisioning_s} | {t.load_s} | {t.resume_s} | "
        f"{t.kill_to_text_s} | {t.pause_p50_s} | {t.tokens_lost} | "
        f"{'yes' if t.same_text else 'NO'}{' ' + t.error if t.error else ''} |"
        for t in trials
    ]
    return "\n".join([head, *rows])


async def bench(args: argparse.Namespace) -> list[Trial]:
    fetch_bundled(DEFAULT_BUNDLED)
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="mvp-bench-recovery-") as tmp:
        for stages in args.stages:
            trials += await bench_run(args, stages, Path(tmp))
    return trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--kill", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--kill-after", type=float, default=1.5, help="seconds of streaming")
    parser.add_argument("--provider", choices=["process", "docker"], default="process")
    parser.add_argument("--cpus", type=float, default=None, help="docker --cpus per node")
    parser.add_argument("--out", type=Path, default=None, help="write the trials as JSON")
    args = parser.parse_args()
    trials = asyncio.run(bench(args))
    print(table(trials))
    if args.out is not None:
        args.out.write_text(json.dumps([asdict(t) for t in trials], indent=2) + "\n")


if __name__ == "__main__":
    main()
