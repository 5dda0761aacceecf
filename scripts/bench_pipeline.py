"""Pipeline benchmark (not a test): for 1, 2 and 3 stages of SmolLM2 on this host, over
loopback, through the whole product (dev server, orchestrator worker, node processes):

- workflow start -> prompt-ready
- decode tokens/s of the engine loop (Done.tokens_generated / Done.elapsed_ms) and as seen
  by a streaming client, on 128-token greedy prompts
- per-hop overhead: (1/pipeline tok/s - 1/in-process tok/s of the same stages, 1 thread)
  divided by the records each token crosses (N+1 edges)
- RSS of each node process

    .venv/bin/python scripts/bench_pipeline.py [--stages 1 2 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

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
from workers.node.runtime import default_threads

PROMPT_IDS = [6403, 1980, 253, 655]  # "Once upon a time"


def in_process(path: str, stages: int, tokens: int, threads: int) -> float:
    layers = stage_layer_ranges(30, stages)
    loaded = [load_stage(path, r.start, r.end, EngineOptions(device="cpu", threads=threads))
              for r in layers]
    try:
        best = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            n = len(list(generate(loaded, PROMPT_IDS, max_new_tokens=tokens, max_seq_len=512,
                                  sampling=SamplingParams(), stop_ids=set())))
            best = max(best, n / (time.perf_counter() - t0))
        return best
    finally:
        for s in loaded:
            s.close()


async def through_product(client, run_id: int, stages: int, tokens: int) -> dict[str, object]:
    req = RunRequest.model_validate({"model": {"bundled": DEFAULT_BUNDLED}, "pipeline_stages": stages})
    t0 = time.perf_counter()
    handle = await client.start_workflow(names.RUN_WORKFLOW, req, id=names.run_workflow_id(run_id),
                                         task_queue=names.ORCHESTRATOR_TASK_QUEUE)
    while (state := await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)).phase != RunPhase.PROMPT_READY:
        if state.stopping:
            raise RuntimeError(state.first_fault)
        await asyncio.sleep(0.05)
    ready = time.perf_counter() - t0
    engine, seen, ttft = [], [], []
    for i in range(3):
        start = time.perf_counter()
        first = None
        done = None
        async for ev in stream_prompt(client, run_id, SubmitPrompt(request_id=i, prompt_text="Once upon a time",
                                                                   max_tokens=tokens)):
            if isinstance(ev, TextDelta) and first is None:
                first = time.perf_counter()
            elif isinstance(ev, Done):
                done = ev
        assert done is not None and first is not None
        engine.append(done.tokens_generated / (done.elapsed_ms / 1000))
        seen.append(done.tokens_generated / (time.perf_counter() - start))
        ttft.append((first - start) * 1000)
    rss = [psutil.Process(n.handle.pid).memory_info().rss / 2**20 for n in state.nodes if n.handle and n.handle.pid]
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
    await handle.result()
    return {"ready": ready, "engine": max(engine), "seen": max(seen), "ttft": min(ttft), "rss": rss}


async def main(args: argparse.Namespace) -> None:
    path = str(fetch_bundled(DEFAULT_BUNDLED))
    tmp = tempfile.mkdtemp(prefix="mvp-bench-")
    server = start_dev_server(os.path.join(tmp, "t.db"))
    env = {**os.environ, "TEMPORAL_ADDRESS": server.address, "MVP_STATE_DIR": tmp}
    worker = subprocess.Popen([sys.executable, "-m", "workers.orchestrator"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        client = await connect(server.address)
        await asyncio.sleep(2)
        for n in args.stages:
            product = await through_product(client, 950 + n, n, args.tokens)
            threads = default_threads(os.cpu_count() or 1, n)
            local = in_process(path, n, args.tokens, threads)
            rows.append((n, product, local, threads))
    finally:
        worker.terminate()
        worker.wait(15)
        server.stop()
    print(f"\nSmolLM2-135M Q4_1, {os.cpu_count()} cores, {args.tokens}-token greedy decode, loopback\n")
    print("| stages | prompt-ready s | engine loop tok/s | client tok/s | first delta ms | "
          "in-process tok/s (threads) | per-hop overhead ms | RSS per node MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for n, p, local, threads in rows:
        per_token = 1 / p["engine"] - 1 / local  # type: ignore[operator]
        hop = per_token / (n + 1) * 1000 if n > 1 else 0.0
        rss = ", ".join(f"{r:.0f}" for r in p["rss"])  # type: ignore[attr-defined]
        print(f"| {n} | {p['ready']:.1f} | {p['engine']:.1f} | {p['seen']:.1f} | {p['ttft']:.0f} | "
              f"{local:.1f} ({threads}) | {hop:.2f} | {rss} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--tokens", type=int, default=128)
    asyncio.run(main(parser.parse_args()))
