"""Pipeline benchmark (not a test): 1, 2 and 3 stages of SmolLM2 on this host, over
loopback, through the whole product (dev server, orchestrator worker, node processes).

All runs are started first (one at a time, timing workflow start -> prompt-ready), then
prompts go to them in interleaved rounds, so slow drift of a shared machine hits every
stage count alike; the ratio to 1 stage is taken per round and its median reported.

- decode tok/s of the engine loop (Done.tokens_generated / Done.elapsed_ms) and as seen
  by a streaming client, on greedy prompts of --tokens tokens
- per-hop overhead: (1/pipeline tok/s - 1/in-process tok/s of the same stages run one
  after another in one thread) divided by the records each token crosses (N+1 edges)
- RSS of each node process

    .venv/bin/python scripts/bench_pipeline.py [--stages 1 2 3] [--tokens 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil

from activities.models_store import DEFAULT_BUNDLED, fetch_bundled
from mvp_core import names
from mvp_core.models import Done, RequestShutdown, RunPhase, RunRequest, SubmitPrompt, TextDelta
from mvp_core.planner import stage_layer_ranges
from mvp_core.run_state import RunState
from temporal.devserver import start_dev_server
from workers.client import stream_prompt
from workers.connect import connect
from workers.engine import EngineOptions, SamplingParams, generate, load_stage
from workers.node.affinity import Placement, compute_set
from workers.node.runtime import default_threads

PROMPT_IDS = [6403, 1980, 253, 655]  # "Once upon a time"
ADDRESS_LAYOUT = "auto"  # engine.address_layout of every run (--address-layout)


def in_process(path: str, stages: int, tokens: int, threads: int) -> float:
    """The same stages one after another in one thread, placed like a node's token path."""
    layers = stage_layer_ranges(30, stages)
    loaded = [load_stage(path, r.start, r.end, EngineOptions(device="cpu", threads=threads))
              for r in layers]
    try:
        rates = []
        with Placement(compute_set("auto"), nice=-5).applied():
            for _ in range(3):
                t0 = time.perf_counter()
                n = len(list(generate(loaded, PROMPT_IDS, max_new_tokens=tokens, max_seq_len=512,
                                      sampling=SamplingParams(), stop_ids=set())))
                rates.append(n / (time.perf_counter() - t0))
        return statistics.median(rates)
    finally:
        for s in loaded:
            s.close()


async def start_run(client: Any, run_id: int, stages: int) -> tuple[Any, float, RunState]:
    req = RunRequest.model_validate({"model": {"bundled": DEFAULT_BUNDLED}, "pipeline_stages": stages,
                                     "engine": {"address_layout": ADDRESS_LAYOUT},
                                     "node_env": dict(kv.split("=", 1) for kv in os.environ.get("BENCH_NODE_ENV", "").split() if kv)})
    t0 = time.perf_counter()
    handle = await client.start_workflow(names.RUN_WORKFLOW, req, id=names.run_workflow_id(run_id),
                                         task_queue=names.ORCHESTRATOR_TASK_QUEUE)
    while (state := await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)).phase != RunPhase.PROMPT_READY:
        if state.stopping:
            raise RuntimeError(state.first_fault)
        await asyncio.sleep(0.05)
    return handle, time.perf_counter() - t0, state


async def one_prompt(client: Any, run_id: int, request_id: int, tokens: int) -> tuple[float, float, float]:
    """(engine tok/s, client tok/s, first delta ms)."""
    start = time.perf_counter()
    first = None
    done = None
    prompt = SubmitPrompt(request_id=request_id, prompt_text="Once upon a time", max_tokens=tokens)
    async for ev in stream_prompt(client, run_id, prompt):
        if isinstance(ev, TextDelta) and first is None:
            first = time.perf_counter()
        elif isinstance(ev, Done):
            done = ev
    assert done is not None and first is not None
    return (done.tokens_generated / (done.elapsed_ms / 1000),
            done.tokens_generated / (time.perf_counter() - start),
            (first - start) * 1000)


async def main(args: argparse.Namespace) -> None:
    path = str(fetch_bundled(DEFAULT_BUNDLED))
    tmp = tempfile.mkdtemp(prefix="mvp-bench-")
    server = start_dev_server(os.path.join(tmp, "t.db"))
    env = {**os.environ, "TEMPORAL_ADDRESS": server.address, "MVP_STATE_DIR": tmp}
    worker = subprocess.Popen([sys.executable, "-m", "workers.orchestrator"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: dict[int, tuple[Any, float, RunState]] = {}
    idle: dict[int, Any] = {}  # run id -> handle of the diagnostic runs that stay idle
    samples: dict[int, list[tuple[float, float, float]]] = {n: [] for n in args.stages}
    try:
        client = await connect(server.address)
        await asyncio.sleep(2)
        for n in args.stages:
            runs[n] = await start_run(client, 950 + n, n)
        for i, n in enumerate(args.idle_runs):
            idle[1050 + i] = (await start_run(client, 1050 + i, n))[0]
        for n in args.stages:  # warm-up: the first prompt of a run pays one-time costs
            await one_prompt(client, 950 + n, 0, 16)
        for r in range(args.rounds):
            for n in args.stages:
                samples[n].append(await one_prompt(client, 950 + n, 1 + r, args.tokens))
        rss = {n: [psutil.Process(x.handle.pid).memory_info().rss / 2**20
                   for x in runs[n][2].nodes if x.handle and x.handle.pid] for n in args.stages}
        to_stop = {950 + n: handle for n, (handle, _, _) in runs.items()} | idle
        for run_id, handle in to_stop.items():
            await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
            await handle.result()
    finally:
        worker.terminate()
        worker.wait(15)
        server.stop()
    local = {n: in_process(path, n, args.tokens, default_threads(os.cpu_count() or 1, n))
             for n in args.stages}
    base = args.stages[0]
    print(f"\nSmolLM2-135M Q4_1, {os.cpu_count()} cores, {args.tokens}-token greedy decode, "
          f"loopback, median of {args.rounds} interleaved rounds\n")
    print(f"| stages | prompt-ready s | engine loop tok/s | vs {base} stage, paired (range) | client tok/s | "
          "first delta ms | in-process tok/s | per-hop overhead ms | RSS per node MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.stages:
        eng = statistics.median(s[0] for s in samples[n])
        ratios = sorted(a[0] / b[0] for a, b in zip(samples[n], samples[base], strict=True))
        ratio = statistics.median(ratios)
        seen = statistics.median(s[1] for s in samples[n])
        ttft = statistics.median(s[2] for s in samples[n])
        hop = (1 / eng - 1 / local[n]) / (n + 1) * 1000 if n > 1 else 0.0
        print(f"| {n} | {runs[n][1]:.1f} | {eng:.1f} | {ratio:.3f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) | {seen:.1f} | {ttft:.0f} | "
              f"{local[n]:.1f} | {hop:.2f} | {', '.join(f'{x:.0f}' for x in rss[n])} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--address-layout", choices=["auto", "fixed", "randomized"], default="auto",
                        help="engine.address_layout of the runs (auto: fixed for 2+ nodes)")
    parser.add_argument("--idle-runs", type=int, nargs="*", default=[],
                        help="stage counts of extra runs kept idle during the rounds")
    args = parser.parse_args()
    ADDRESS_LAYOUT = args.address_layout
    asyncio.run(main(args))
