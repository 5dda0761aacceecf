"""Gateway benchmark (not a test): time to first token and decode tokens/s of one 2-stage
run of the bundled SmolLM2, through ``mvp-gateway`` (the official ``openai`` client,
streamed and not) against ``workers.client.stream_prompt`` straight to the run.

Everything is local and started here: a dev server, an orchestrator worker, the run
(``--stages``, default 2), and ``mvp-gateway --workflow-id`` as its own process, as a
user runs it. Each round sends the same greedy prompt once per path, interleaved, so a
shared machine's drift hits every path alike; the table gives medians (and the range).

- TTFT: request sent -> first text received (ms)
- decode tok/s: (tokens - 1) / (last text - first text), as the client sees the text
  arrive (the run flushes text every ``stream_batch_ms``, 100 ms by default, so a short
  reply's figure is coarse); for the non-streamed path: tokens / whole request
- total: request sent -> response complete (ms)
- the run's own figure: Done.tokens_generated / Done.elapsed_ms of the direct path

    .venv/bin/python scripts/bench_gateway.py [--rounds 5] [--tokens 128] [--stages 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from activities.models_store import DEFAULT_BUNDLED, fetch_bundled
from mvp_core import names
from mvp_core.models import Done, RequestShutdown, RunPhase, RunRequest, SubmitPrompt, TextDelta
from mvp_core.run_state import RunState
from temporal.devserver import start_dev_server
from workers.client import start_run, stream_prompt
from workers.connect import connect
from workers.embedded import start_worker, stop_process

RUN_ID = 970
PROMPT = "Once upon a time"


@dataclass
class Sample:
    ttft_ms: float | None
    tok_s: float
    total_ms: float
    tokens: int
    engine_tok_s: float | None = None  # Done.tokens_generated / Done.elapsed_ms (direct only)


@dataclass
class Series:
    name: str
    samples: list[Sample] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sample(start: float, first: float | None, last: float, tokens: int, end: float) -> Sample:
    if first is None or tokens < 2 or last <= first:
        rate = tokens / (end - start)
    else:
        rate = (tokens - 1) / (last - first)
    return Sample(
        None if first is None else (first - start) * 1000, rate, (end - start) * 1000, tokens
    )


async def direct(client: Any, request_id: int, tokens: int) -> Sample:
    prompt = SubmitPrompt(request_id=request_id, prompt_text=PROMPT, max_tokens=tokens)
    start = time.perf_counter()
    first = last = None
    done: Done | None = None
    async for ev in stream_prompt(client, RUN_ID, prompt):
        if isinstance(ev, TextDelta):
            last = time.perf_counter()
            first = first or last
        elif isinstance(ev, Done):
            done = ev
        else:
            raise RuntimeError(f"prompt faulted: {ev}")
    end = time.perf_counter()
    assert done is not None
    sample = _sample(start, first, last or end, done.tokens_generated, end)
    sample.engine_tok_s = done.tokens_generated / max(done.elapsed_ms / 1000, 1e-9)
    return sample


async def gateway_stream(oai: AsyncOpenAI, model: str, tokens: int) -> Sample:
    start = time.perf_counter()
    first = last = None
    used = 0
    stream = await oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    end = time.perf_counter()
    return _sample(start, first, last or end, used, end)


async def gateway_whole(oai: AsyncOpenAI, model: str, tokens: int) -> Sample:
    start = time.perf_counter()
    got = await oai.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0)
    end = time.perf_counter()
    assert got.usage is not None
    return _sample(start, None, end, got.usage.completion_tokens, end)


def _wait_for(path: Path, text: str, proc: subprocess.Popen[Any], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited: {content[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"{text!r} not seen in {path} within {timeout_s:.0f} s")


async def bench(args: argparse.Namespace) -> list[Series]:
    fetch_bundled(DEFAULT_BUNDLED)
    tmp = Path(tempfile.mkdtemp(prefix="mvp-bench-gateway-"))
    print(f"bench state and logs: {tmp}", file=sys.stderr)
    server = start_dev_server(str(tmp / "t.db"), log_file=str(tmp / "temporal.log"))
    worker_log = tmp / "orchestrator.log"
    worker = start_worker(server.address, tmp, worker_log, {names.REAPER_INTERVAL_ENV: "0"})
    gateway: subprocess.Popen[bytes] | None = None
    handle = None
    try:
        await asyncio.to_thread(_wait_for, worker_log, "worker ready", worker, 60)
        client = await connect(server.address)
        request = RunRequest.model_validate(
            {"model": {"bundled": DEFAULT_BUNDLED}, "pipeline_stages": args.stages}
        )
        t0 = time.perf_counter()
        handle = await start_run(client, RUN_ID, request)
        while True:
            state = await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)
            if state.phase is RunPhase.PROMPT_READY:
                break
            if state.stopping:
                raise RuntimeError(f"run stopped before prompt-ready: {state.first_fault}")
            await asyncio.sleep(0.1)
        print(
            f"{args.stages}-stage run prompt-ready in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        port = _free_port()
        gw_log = tmp / "gateway.log"
        with open(gw_log, "wb") as out:
            gateway = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "workers.gateway.main",
                    "--workflow-id",
                    names.run_workflow_id(RUN_ID),
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--log-level",
                    "warning",
                ],
                env={**os.environ, "TEMPORAL_ADDRESS": server.address},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        await asyncio.to_thread(_wait_for, gw_log, "is prompt-ready", gateway, 60)
        oai = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        model = (await oai.models.list()).data[0].id
        paths = [
            Series("`stream_prompt` (direct, streamed)"),
            Series("gateway `/v1/completions`, streamed"),
            Series("gateway `/v1/completions`, not streamed"),
        ]
        request_id = 0

        def next_id() -> int:
            nonlocal request_id
            request_id += 1
            return request_id

        runs: list[Callable[[], Any]] = [
            lambda: direct(client, next_id(), args.tokens),
            lambda: gateway_stream(oai, model, args.tokens),
            lambda: gateway_whole(oai, model, args.tokens),
        ]
        for run in runs:  # warm-up: the first prompt of each path pays one-time costs
            await run()
        for _ in range(args.rounds):
            for path, run in zip(paths, runs, strict=True):
                path.samples.append(await run())
        await oai.close()
        return paths
    finally:
        if gateway is not None:
            gateway.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                gateway.wait(15)
        if handle is not None:
            with contextlib.suppress(Exception):
                await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=RUN_ID))
                await asyncio.wait_for(handle.result(), 60)
        stop_process(worker, 15)
        server.stop()


def _cell(values: list[float], spec: str) -> str:
    if not values:
        return "-"
    mid = statistics.median(values)
    return f"{mid:{spec}} ({min(values):{spec}}-{max(values):{spec}})"


def table(paths: list[Series], args: argparse.Namespace) -> str:
    base = paths[0]
    lines = [
        f"SmolLM2-135M Q4_1, {args.stages} stages, {os.cpu_count()} cores, {args.tokens}-token "
        f"greedy prompt {PROMPT!r}, median (min-max) of {args.rounds} interleaved rounds",
        "",
        "| path | TTFT ms | decode tok/s | total ms | tokens |",
        "|---|---|---|---|---|",
    ]
    for path in paths:
        ttft = [s.ttft_ms for s in path.samples if s.ttft_ms is not None]
        lines.append(
            f"| {path.name} | {_cell(ttft, '.0f')} | {_cell([s.tok_s for s in path.samples], '.1f')} "
            f"| {_cell([s.total_ms for s in path.samples], '.0f')} "
            f"| {statistics.median(s.tokens for s in path.samples):.0f} |"
        )
    engine = [s.engine_tok_s for s in base.samples if s.engine_tok_s is not None]
    if engine:
        lines += [
            "",
            f"The run's own decode (Done.elapsed_ms, direct path): {_cell(engine, '.1f')} tok/s.",
        ]
    ttft_gw = [s.ttft_ms for s in paths[1].samples if s.ttft_ms is not None]
    ttft_direct = [s.ttft_ms for s in base.samples if s.ttft_ms is not None]
    if ttft_gw and ttft_direct:
        added = statistics.median(ttft_gw) - statistics.median(ttft_direct)
        lines += ["", f"The gateway adds {added:.0f} ms to the median time to first token."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--stages", type=int, default=2)
    args = p.parse_args()
    paths = asyncio.run(bench(args))
    print(table(paths, args))


if __name__ == "__main__":
    main()
