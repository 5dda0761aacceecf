"""Measure the run spine on this machine (not a test): time to prompt-ready, time to
first text delta and tokens/s seen by a streaming client, and history events per prompt
on the run workflow. Starts its own dev server and orchestrator worker.

    .venv/bin/python scripts/bench_spine.py --prompts 5
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

from mvp_core import names
from mvp_core.models import Done, RequestShutdown, RunPhase, RunRequest, SubmitPrompt, TextDelta
from mvp_core.run_state import RunState
from temporal.client import RunHandle
from temporal.connect import TemporalSettings, connect, local_server_env
from temporal.devserver import start_dev_server


async def main(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="mvp-bench-")
    server = start_dev_server(os.path.join(tmp, "t.db"))
    env = {**local_server_env(server.address), "MVP_STATE_DIR": tmp}
    worker = subprocess.Popen(
        [sys.executable, "-m", "workers.orchestrator"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = await connect(settings=TemporalSettings.local(server.address))
        await asyncio.sleep(2)
        req = RunRequest.model_validate(
            {"model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"}, "pipeline_stages": args.stages}
        )
        t0 = time.perf_counter()
        handle = await client.start_workflow(
            names.RUN_WORKFLOW,
            req,
            id=names.run_workflow_id(900),
            task_queue=names.ORCHESTRATOR_TASK_QUEUE,
        )
        while (
            await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)
        ).phase != RunPhase.PROMPT_READY:
            await asyncio.sleep(0.05)
        ready = time.perf_counter() - t0
        events_before = len((await handle.fetch_history()).events)
        ttft, tps = [], []
        for i in range(args.prompts):
            start = time.perf_counter()
            first = None
            done = None
            async for ev in RunHandle(client, 900).stream(
                SubmitPrompt(request_id=i, prompt_text="Once upon a time", max_tokens=64),
            ):
                if isinstance(ev, TextDelta) and first is None:
                    first = time.perf_counter()
                elif isinstance(ev, Done):
                    done = ev
            end = time.perf_counter()
            assert done is not None and first is not None
            ttft.append((first - start) * 1000)
            tps.append(done.tokens_generated / (end - start))
        events_after = len((await handle.fetch_history()).events)
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=900))
        await handle.result()
        print(f"stages                         {args.stages}")
        print(f"workflow start -> prompt-ready {ready:.2f} s")
        print(
            f"time to first text delta       p50 {statistics.median(ttft):.0f} ms (min {min(ttft):.0f}, max {max(ttft):.0f})"
        )
        print(f"tokens/s seen by the client    p50 {statistics.median(tps):.1f} (64-token prompts)")
        print(
            f"history events per prompt      {(events_after - events_before) / args.prompts:.1f} on {handle.id}"
        )
    finally:
        worker.terminate()
        worker.wait(15)
        server.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--stages", type=int, default=1)
    asyncio.run(main(p.parse_args()))
