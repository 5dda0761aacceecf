"""The main job on the embedded default: ``python -m workers.demo``.

Starts a local Temporal dev server (SQLite under .temporal/), an orchestrator worker,
a run on the bundled SmolLM2 model with local process nodes, streams a reply to the
terminal as it is generated, shuts the run down and stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from mvp_core import names
from mvp_core.models import (
    Done,
    Fault,
    RequestShutdown,
    RunOutcome,
    RunRequest,
    SubmitPrompt,
    TextDelta,
)
from mvp_core.run_state import RunState
from temporal.devserver import start_dev_server
from workers.client import stream_prompt
from workers.connect import connect

DEFAULT_PROMPT = "The capital of France is"


async def demo(args: argparse.Namespace) -> int:
    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    print(f"starting Temporal dev server (db {root / 'dev.db'})", flush=True)
    server = start_dev_server(
        str(root / "dev.db"), headless=False, log_file=str(root / "temporal.log")
    )
    print(f"  gRPC {server.address}, Web UI http://127.0.0.1:{server.ui_port}", flush=True)
    env = {**os.environ, "TEMPORAL_ADDRESS": server.address, "PYTHONUNBUFFERED": "1"}
    worker_log = open(root / "orchestrator.log", "ab")
    worker = subprocess.Popen(
        [sys.executable, "-m", "workers.orchestrator"],
        env=env,
        stdout=worker_log,
        stderr=subprocess.STDOUT,
    )
    try:
        client = await connect(server.address)
        run_id = args.run_id or int(time.time()) % 1_000_000
        request = RunRequest.model_validate(
            {
                "model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"},
                "pipeline_stages": args.stages,
                "default_max_tokens": args.max_tokens,
            }
        )
        t0 = time.perf_counter()
        handle = await client.start_workflow(
            names.RUN_WORKFLOW,
            request,
            id=names.run_workflow_id(run_id),
            task_queue=names.ORCHESTRATOR_TASK_QUEUE,
        )
        print(
            f"run {handle.id} started; waiting for prompt-ready "
            "(first use downloads the bundled model)",
            flush=True,
        )
        while True:
            state = await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)
            if state.phase.value == "prompt_ready":
                break
            if state.stopping:
                print(f"run failed: {state.first_fault}", file=sys.stderr)
                return 1
            await asyncio.sleep(0.2)
        ready_s = time.perf_counter() - t0
        print(f"prompt-ready after {ready_s:.2f}s ({len(state.nodes)} node(s))\n", flush=True)
        t1 = time.perf_counter()
        first: float | None = None
        print(f"prompt:> {args.prompt}", flush=True)
        sys.stdout.write(args.prompt)
        result: Done | Fault | None = None
        async for event in stream_prompt(
            client,
            run_id,
            SubmitPrompt(
                request_id=1, prompt_text=args.prompt, max_tokens=args.max_tokens, chat=args.chat
            ),
        ):
            if isinstance(event, TextDelta):
                first = first or time.perf_counter()
                sys.stdout.write(event.text)
                sys.stdout.flush()
            else:
                result = event
        print()
        if isinstance(result, Fault):
            print(f"error: {result.error}", file=sys.stderr)
        elif isinstance(result, Done) and first is not None:
            total = time.perf_counter() - t1
            print(
                f"\n[{result.tokens_generated} tokens; first text after {(first - t1) * 1000:.0f} ms; "
                f"{result.tokens_generated / max(total, 1e-9):.1f} tokens/s seen by the client; "
                f"engine {result.elapsed_ms} ms]",
                flush=True,
            )
        outcome = await handle.execute_update(
            "request_shutdown_and_wait", RequestShutdown(run_id=run_id), result_type=RunOutcome
        )
        print(
            f"run {outcome.outcome.value}: "
            + " -> ".join(
                r.kind.value for r in outcome.lifecycle if not r.kind.value.startswith("Prompt")
            )
        )
        await handle.result()
        return 0 if isinstance(result, Done) else 1
    finally:
        worker.terminate()
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--run-id", type=int, default=0)
    parser.add_argument("--data-dir", default=".temporal/demo")
    raise SystemExit(asyncio.run(demo(parser.parse_args())))


if __name__ == "__main__":
    main()
