"""Gateway benchmark (not a test): time to first token and decode tokens/s of one 2-stage
run of the bundled SmolLM2, through ``mvp-gateway`` (the official ``openai`` client,
streamed and not) against ``temporal.client.RunHandle.stream`` straight to the run, and
against llama-cpp-python's own OpenAI server on the same GGUF when llama_cpp is
installed (``python -m llama_cpp.server --n_threads 2`` on loopback; ``--llama-server
off`` leaves it out).

Everything is local and started here: a dev server, an orchestrator worker, the run
(``--stages``, default 2), and ``mvp-gateway --workflow-id`` as its own process, as a
user runs it. Each round sends one greedy prompt once per path, interleaved, so a shared
machine's drift hits every path alike (round i uses PROMPTS[i], so llama.cpp's prompt
cache never holds the next prompt); the table gives medians (and the range). Both OpenAI
servers get the same requests from the same client code: temperature 0, max_tokens,
``repeat_penalty`` 1.0 (llama.cpp's default is 1.1; the gateway ignores the field).
llama.cpp's server runs with OMP_WAIT_POLICY=PASSIVE unless set, as the nodes do.

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

from mvp_core import names
from mvp_core.models import Done, RequestShutdown, RunPhase, RunRequest, SubmitPrompt, TextDelta
from mvp_core.run_state import RunState
from mvp_io.model_store import DEFAULT_BUNDLED, fetch_bundled
from temporal.client import RunHandle
from temporal.connect import connect
from temporal.devserver import start_dev_server
from workers.host.embedded import start_worker, stop_process

RUN_ID = 970
PROMPT = "Once upon a time"  # the warm-up prompt
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "Here is a short story about a dragon:",
    "In the morning the baker",
    "Water boils at",
    "My favourite book is",
    "A long time ago in a small village",
    "Scientists have discovered",
]
SAME_REQUEST = {"repeat_penalty": 1.0}  # llama.cpp's default is 1.1; the gateway ignores it
LLAMA_THREADS = 2


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
    key: str = ""  # short name in the report's JSON
    samples: list[Sample] = field(default_factory=list)


@dataclass
class Result:
    paths: list[Series]
    prompt_ready_s: float
    llama: str  # llama-cpp-python's version, or why its server is not in the table


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


async def direct(client: Any, request_id: int, tokens: int, text: str = PROMPT) -> Sample:
    prompt = SubmitPrompt(request_id=request_id, prompt_text=text, max_tokens=tokens)
    start = time.perf_counter()
    first = last = None
    done: Done | None = None
    async for ev in RunHandle(client, RUN_ID).stream(prompt):
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


async def gateway_stream(oai: AsyncOpenAI, model: str, tokens: int, text: str = PROMPT) -> Sample:
    """One streamed completion through an OpenAI-compatible server (the gateway or
    llama.cpp's): the same request either way."""
    start = time.perf_counter()
    first = last = None
    used = 0
    chunks = 0
    stream = await oai.completions.create(
        model=model,
        prompt=text,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=SAME_REQUEST,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
            chunks += 1
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    end = time.perf_counter()
    # A server without the usage chunk: one text chunk per token (llama.cpp streams so).
    return _sample(start, first, last or end, used or chunks, end)


async def gateway_whole(oai: AsyncOpenAI, model: str, tokens: int, text: str = PROMPT) -> Sample:
    start = time.perf_counter()
    got = await oai.completions.create(
        model=model, prompt=text, max_tokens=tokens, temperature=0, extra_body=SAME_REQUEST
    )
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


def llama_available() -> str | None:
    """Why llama-cpp-python's server cannot run here, or None when it can."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "not installed"
    missing = [
        m
        for m in ("fastapi", "sse_starlette", "starlette_context", "pydantic_settings", "uvicorn")
        if importlib.util.find_spec(m) is None
    ]
    return f"llama_cpp installed without its server's {', '.join(missing)}" if missing else None


def llama_version() -> str:
    from importlib.metadata import version

    return version("llama_cpp_python")


async def start_llama_server(
    model_path: str, tmp: Path, threads: int
) -> tuple[subprocess.Popen[bytes], AsyncOpenAI, str]:
    """``python -m llama_cpp.server`` on a free loopback port, once it answers /v1/models."""
    port = _free_port()
    log = tmp / "llama-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                model_path,
                "--n_threads",
                str(threads),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            # As the process provider starts nodes: OpenMP threads that spin while they wait
            # stall behind every other process of a loaded machine (llama.cpp's 2-thread
            # prefill fell from ~65 to ~4 tok/s on 2 busy cores without it).
            env={**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    oai = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    deadline = time.monotonic() + 120
    while True:
        try:
            model = (await oai.models.list()).data[0].id
            return proc, oai, model
        except Exception:
            if proc.poll() is not None:
                await oai.close()
                raise RuntimeError(
                    f"llama_cpp.server exited: {log.read_text(errors='replace')[-2000:]}"
                ) from None
            if time.monotonic() > deadline:
                proc.terminate()
                await oai.close()
                raise RuntimeError("llama_cpp.server did not answer within 120 s") from None
            await asyncio.sleep(0.5)


async def bench(args: argparse.Namespace) -> Result:
    """``args``: rounds, tokens, stages and llama_server ("auto" or "off")."""
    model_path = str(fetch_bundled(DEFAULT_BUNDLED))
    tmp = Path(tempfile.mkdtemp(prefix="mvp-bench-gateway-"))
    print(f"bench state and logs: {tmp}", file=sys.stderr)
    server = start_dev_server(str(tmp / "t.db"), log_file=str(tmp / "temporal.log"))
    worker_log = tmp / "orchestrator.log"
    worker = start_worker(server.address, tmp, worker_log, {names.REAPER_INTERVAL_ENV: "0"})
    gateway: subprocess.Popen[bytes] | None = None
    llama: subprocess.Popen[bytes] | None = None
    handle = None
    try:
        await asyncio.to_thread(_wait_for, worker_log, "worker ready", worker, 60)
        client = await connect(server.address)
        request = RunRequest.model_validate(
            {"model": {"bundled": DEFAULT_BUNDLED}, "pipeline_stages": args.stages}
        )
        t0 = time.perf_counter()
        handle = (await RunHandle.start(client, RUN_ID, request)).workflow
        while True:
            state = await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)
            if state.phase is RunPhase.PROMPT_READY:
                break
            if state.stopping:
                raise RuntimeError(f"run stopped before prompt-ready: {state.first_fault}")
            await asyncio.sleep(0.1)
        ready_s = time.perf_counter() - t0
        print(f"{args.stages}-stage run prompt-ready in {ready_s:.1f} s", file=sys.stderr)
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
            Series("`stream_prompt` (direct, streamed)", "direct"),
            Series("gateway `/v1/completions`, streamed", "gateway_stream"),
            Series("gateway `/v1/completions`, not streamed", "gateway_whole"),
        ]
        request_id = 0

        def next_id() -> int:
            nonlocal request_id
            request_id += 1
            return request_id

        runs: list[Callable[[str], Any]] = [
            lambda text: direct(client, next_id(), args.tokens, text),
            lambda text: gateway_stream(oai, model, args.tokens, text),
            lambda text: gateway_whole(oai, model, args.tokens, text),
        ]
        why_not = (
            llama_available() if args.llama_server == "auto" else "left out (--llama-server off)"
        )
        llama_oai: AsyncOpenAI | None = None
        if why_not is None:
            try:
                llama, llama_oai, llama_model = await start_llama_server(
                    model_path, tmp, LLAMA_THREADS
                )
            except RuntimeError as err:
                why_not = f"its server did not start: {err}"
            else:
                oai_llama = llama_oai
                paths.append(
                    Series(
                        f"llama-cpp-python server `/v1/completions`, streamed "
                        f"({LLAMA_THREADS} threads)",
                        "llama_server_stream",
                    )
                )
                runs.append(lambda text: gateway_stream(oai_llama, llama_model, args.tokens, text))
        for run in runs:  # warm-up: the first prompt of each path pays one-time costs
            await run(PROMPT)
        for i in range(args.rounds):
            text = PROMPTS[i % len(PROMPTS)]
            for path, run in zip(paths, runs, strict=True):
                path.samples.append(await run(text))
        await oai.close()
        if llama_oai is not None:
            await llama_oai.close()
        return Result(paths, ready_s, why_not or llama_version())
    finally:
        for proc in (gateway, llama):
            if proc is not None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(15)
        if handle is not None:
            with contextlib.suppress(Exception):
                await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=RUN_ID))
                async with asyncio.timeout(60):
                    await handle.result()
        stop_process(worker, 15)
        server.stop()


def _cell(values: list[float], spec: str) -> str:
    if not values:
        return "-"
    mid = statistics.median(values)
    return f"{mid:{spec}} ({min(values):{spec}}-{max(values):{spec}})"


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def figures(result: Result, args: argparse.Namespace) -> dict[str, Any]:
    """The result as plain data (ms, tok/s; median, min, max over the rounds). Each path's
    ``ttft_vs_direct_ms``: its TTFT less the direct path's in the same round (paired)."""
    rows = []
    direct = result.paths[0].samples
    for path in result.paths:
        engine = [s.engine_tok_s for s in path.samples if s.engine_tok_s is not None]
        paired = [
            s.ttft_ms - d.ttft_ms
            for s, d in zip(path.samples, direct, strict=True)
            if s.ttft_ms is not None and d.ttft_ms is not None
        ]
        rows.append(
            {
                "key": path.key,
                "name": path.name,
                "ttft_ms": _stats([s.ttft_ms for s in path.samples if s.ttft_ms is not None]),
                "decode_tok_s": _stats([s.tok_s for s in path.samples]),
                "total_ms": _stats([s.total_ms for s in path.samples]),
                "tokens": statistics.median(s.tokens for s in path.samples),
                "engine_tok_s": _stats(engine),
                "ttft_vs_direct_ms": _stats(paired) if path is not result.paths[0] else None,
                "samples": [
                    {
                        "ttft_ms": s.ttft_ms,
                        "tok_s": s.tok_s,
                        "total_ms": s.total_ms,
                        "tokens": s.tokens,
                    }
                    for s in path.samples
                ],
            }
        )
    return {
        "stages": args.stages,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "prompts": [PROMPTS[i % len(PROMPTS)] for i in range(args.rounds)],
        "prompt_ready_s": result.prompt_ready_s,
        "llama_cpp": result.llama,
        "llama_threads": LLAMA_THREADS,
        "paths": rows,
    }


def table(result: Result, args: argparse.Namespace) -> str:
    paths = result.paths
    base = paths[0]
    lines = [
        f"SmolLM2-135M Q4_1, {args.stages} stages, {os.cpu_count()} cores, {args.tokens}-token "
        f"greedy prompts, median (min-max) of {args.rounds} interleaved rounds; "
        f"llama-cpp-python server: {result.llama}",
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
    p.add_argument("--llama-server", choices=["auto", "off"], default="auto")
    args = p.parse_args()
    result = asyncio.run(bench(args))
    print(table(result, args))


if __name__ == "__main__":
    main()
