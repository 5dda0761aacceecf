"""Serving benchmark (figures, not a test): many concurrent streams through ``mvp-gateway``
against llama.cpp's own ``llama-server`` with the same number of slots (issue 22).

Everything is local and started here: a dev server, an orchestrator worker, one run per
``--stages`` value with ``max_active_prompts`` = the largest level, and ``mvp-gateway
--workflow-id`` as its own process, as a user runs it. For each level c (``--levels``,
default 1 4 8 16) c greedy streamed completions of ``--tokens`` tokens go out at once
(distinct prompts), ``--rounds`` times; a "sequential" row sends 8 one after another.
With ``--llama-server PATH`` (a ``llama-server`` binary built from the llama.cpp sources
in the llama-cpp-python 0.3.36 sdist, README "Benchmarks"), the same requests go to
``llama-server -np c -t 2`` on the same GGUF in the same run of this script.

- aggregate tok/s: completion tokens of all streams / wall time of the level
- TTFT: request sent -> first text (ms), p50, p95 and p99 over every stream of the level
  (with 50 streams or fewer, p99 is the slowest one)
- ITL: a stream's (last text - first text) / (tokens - 1), p50, p95 and p99 over streams (the
  run flushes text every ``stream_batch_ms``, so a stream's text comes in batches)
- control-plane CPU per token: user+system CPU of the dev server, the orchestrator worker
  and the gateway during the level (from /proc), over its completion tokens

    .venv/bin/python scripts/bench_serve.py [--stages 1 2] [--levels 1 4 8 16]
        [--tokens 128] [--rounds 2] [--llama-server PATH] [--report docs/benchmarks]
        [--text direct|temporal] [--provider docker --cpus 1] [--threads N]

``--provider docker --cpus 1`` runs each stage in a container limited to one CPU (the
Docker daemon at ``DOCKER_HOST``): 2 stages against 1 at 8 streams shows the pipeline
filled (each stage busy on some prompts while the other works on others).

``--report DIR`` writes DIR/serve.md (the table), DIR/serve.json (the figures) and
DIR/serve.png (aggregate tok/s and TTFT p50 by concurrent streams, per server and stages).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib
from openai import AsyncOpenAI
from temporalio.client import Client

matplotlib.use("Agg")  # before pyplot: files only, no display
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: scripts/ and the packages importable
    sys.path.insert(0, str(REPO))

from mvp_core import names  # noqa: E402
from mvp_core.models import (  # noqa: E402
    MAX_ACTIVE_PROMPTS,
    PromptOutcome,
    RequestShutdown,
    RunPhase,
    RunRequest,
)
from mvp_core.run_state import RunState  # noqa: E402
from mvp_io.model_store import DEFAULT_BUNDLED, fetch_bundled  # noqa: E402
from scripts.bench_gateway import _free_port, _wait_for  # noqa: E402
from temporal.client import RunHandle  # noqa: E402
from temporal.connect import connect  # noqa: E402
from temporal.devserver import start_dev_server  # noqa: E402
from workers.dashboard.view import finished_prompts  # noqa: E402
from workers.host.embedded import start_worker, stop_process  # noqa: E402

RUN_ID = 980
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "Here is a short story about a dragon:",
    "In the morning the baker",
    "Water boils at",
    "My favourite book is",
    "A long time ago in a small village",
    "Scientists have discovered",
    "The best way to learn a language is",
    "On the first day of school",
    "The history of the city",
    "When the rain stopped",
    "The old lighthouse keeper",
    "Every summer my family",
    "The recipe calls for",
    "Deep in the forest",
]
# The chat workload's shared system prompt (~512 tokens of SmolLM2's vocabulary): every
# request starts with it, as an application's chats do, so a server that reuses a shared
# prefix prefills it once (DECISIONS 91; llama-server: its slots' prompt cache).
SYSTEM = (
    "You are a careful assistant for a small bakery's online shop. Answer in plain "
    "sentences, at most a short paragraph, without lists or markdown. The shop sells "
    "sourdough, rye and spelt loaves, croissants, cinnamon buns, seasonal fruit tarts and "
    "birthday cakes made to order; cakes need two days' notice and a deposit of ten "
    "percent. Opening hours are seven to six on weekdays, eight to two on Saturdays, and "
    "the shop is closed on Sundays and public holidays. Deliveries go out within five "
    "kilometres for a flat fee, free above forty euros, between ten and four. Every loaf "
    "is baked the same morning; what is left at closing goes to the food bank down the "
    "street. Allergens: all products are made in a kitchen that handles wheat, nuts, "
    "milk, eggs and sesame, so nothing can be promised free of them, and customers with "
    "allergies should call the shop before ordering. Payment is by card or cash in the "
    "shop and by card online; gift vouchers can be bought in any amount and are valid for "
    "a year. Returns: a product that is not right is replaced or refunded the same day "
    "with the receipt. If a question is not about the shop, say politely that you can "
    "only help with the bakery, and suggest calling the shop for anything you are not "
    "sure of. Never invent prices: if asked, say that prices are on the website and in "
    "the shop. Orders for collection can be placed online until eight in the evening for "
    "the next morning; they wait at the counter under the customer's name until noon, "
    "after which they go back on the shelves. Large orders for offices, schools and "
    "parties, anything above twenty loaves or five cakes, need a week's notice and are "
    "confirmed by phone by the head baker, who may suggest changes to the quantities. "
    "Wedding cakes are not made in the shop; point such customers to the cake studio on "
    "the market square, which the bakery works with. The shop runs classes on Saturday "
    "afternoons: bread basics, sourdough starters and pastry, each for eight people, "
    "booked online and paid in advance; a booking can be moved once, free of charge, up "
    "to three days before the class. Loyalty cards give a free loaf for every ten "
    "bought, stamped at the till; lost cards cannot be replaced. The shop does not sell "
    "coffee or sandwiches, has no seats, and does not allow dogs inside. Complaints go to "
    "the manager by email, and are answered within two working days."
)
SAME_REQUEST = {"repeat_penalty": 1.0}  # llama.cpp's default is 1.1; the gateway ignores it
LLAMA_THREADS = 2
SEQUENTIAL = 8
IDLE_S = 10.0
# The dev server reports its counters every second or so: a level's calls are read this
# long after it (less what the server does at rest meanwhile, REST_CALLS per second),
# and this long after the previous level's reads.
SETTLE_S = 2.0
REST_CALLS: dict[str, float] = {}
NOTES: list[str] = []  # lines under the table (the control plane at rest)
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Stream:
    ttft_ms: float | None
    itl_ms: float | None
    tokens: int


@dataclass
class Level:
    server: str  # "mvp" or "llama-server"
    stages: int
    concurrency: int  # 0: SEQUENTIAL one after another
    wall_s: float
    tokens: int
    aggregate_tok_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    itl_p50_ms: float | None
    itl_p95_ms: float | None
    cp_cpu_ms_per_token: float | None  # control plane (dev server, worker, gateway)
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    cp_split_ms_per_token: list[float] | None = None  # each of the three
    # Medians over the level's prompts (their PromptOutcome): queued in the run, tokenize,
    # encode end -> first token (joining the batch and the prefill), first token -> text out.
    ttft_split_ms: list[float] | None = None
    # The share of them the head node started early, while the run admitted them: their
    # encode and prefill overlap admission (DECISIONS 103).
    early_share: float | None = None
    # The dev server's frontend calls per prompt, by operation (its /metrics), and its
    # persistence requests per prompt: what the level cost the server, call by call.
    server_calls_per_prompt: dict[str, float] | None = None
    persistence_per_prompt: float | None = None


METRIC_LINE = re.compile(r"^(\w+)\{([^}]*)\}\s+([0-9.eE+-]+)$")


def server_calls(metrics_port: int | None) -> Counter[str]:
    """The dev server's request counters now: frontend calls by operation, and
    ``persistence`` (its requests to its database, all operations)."""
    if metrics_port is None:
        return Counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Counter[str] = Counter()
    for line in text.splitlines():
        m = METRIC_LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        if name == "persistence_requests":
            out["persistence"] += int(float(value))
        elif name == "service_requests" and 'service_name="frontend"' in labels:
            op = re.search(r'operation="(\w+)"', labels)
            if op is not None:
                out[op.group(1)] += int(float(value))
    return out


def _cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (after the name)
    return total / CLK_TCK


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def one_stream(
    oai: AsyncOpenAI, model: str, text: str, tokens: int, workload: str = "completion"
) -> Stream:
    """One greedy streamed request: a completion of ``text``, or (``workload`` "chat") a
    chat turn asking ``text`` after the shared SYSTEM prompt."""
    start = time.perf_counter()
    first = last = None
    used = chunks = 0
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": SAME_REQUEST,
    }
    stream: Any
    if workload == "chat":
        messages: Any = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": text},
        ]
        stream = await oai.chat.completions.create(messages=messages, **common)
    else:
        stream = await oai.completions.create(prompt=text, **common)
    async for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        piece = (
            None
            if choice is None
            else (choice.delta.content if workload == "chat" else choice.text)
        )
        if piece:
            last = time.perf_counter()
            first = first or last
            chunks += 1
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    n = used or chunks  # llama-server streams a chunk per token
    ttft = None if first is None else (first - start) * 1000
    itl = None
    if first is not None and last is not None and n > 1 and last > first:
        itl = (last - first) * 1000 / (n - 1)
    return Stream(ttft, itl, n)


async def level(
    oai: AsyncOpenAI,
    model: str,
    concurrency: int,
    args: argparse.Namespace,
    cpu_pids: list[int],
    *,
    server: str,
    stages: int,
    client: Client | None = None,
    metrics_port: int | None = None,
) -> Level:
    streams: list[Stream] = []
    wall = 0.0
    started = datetime.now(UTC)
    if metrics_port is not None:
        await asyncio.sleep(SETTLE_S)
    calls0 = server_calls(metrics_port)
    cpu0 = _cpu_s(cpu_pids)
    each0 = [_cpu_s([pid]) for pid in cpu_pids]
    for r in range(args.rounds):
        t0 = time.perf_counter()
        if concurrency == 0:
            for i in range(SEQUENTIAL):
                text = PROMPTS[(r + i) % len(PROMPTS)]
                streams.append(await one_stream(oai, model, text, args.tokens, args.workload))
        else:
            texts = [PROMPTS[(r + i) % len(PROMPTS)] for i in range(concurrency)]
            streams += await asyncio.gather(
                *(one_stream(oai, model, t, args.tokens, args.workload) for t in texts)
            )
        wall += time.perf_counter() - t0
    cpu = _cpu_s(cpu_pids) - cpu0
    each = [_cpu_s([pid]) - c0 for pid, c0 in zip(cpu_pids, each0, strict=True)]
    if metrics_port is not None:
        await asyncio.sleep(SETTLE_S)
    calls = server_calls(metrics_port)
    calls.subtract(calls0)
    for op, rate in REST_CALLS.items():
        calls[op] -= round(rate * SETTLE_S)
    tokens = sum(s.tokens for s in streams)
    prompts = len(streams)
    persistence = calls.pop("persistence", 0)
    ttft = [s.ttft_ms for s in streams if s.ttft_ms is not None]
    itl = [s.itl_ms for s in streams if s.itl_ms is not None]
    split = (
        None
        if client is None
        else await ttft_split(
            client, started, args.prompt_host, names.run_workflow_id(RUN_ID + stages)
        )
    )
    lv = Level(
        server=server,
        stages=stages,
        concurrency=concurrency,
        wall_s=wall,
        tokens=tokens,
        aggregate_tok_s=tokens / wall if wall > 0 else 0.0,
        ttft_p50_ms=_pct(ttft, 0.5),
        ttft_p95_ms=_pct(ttft, 0.95),
        itl_p50_ms=_pct(itl, 0.5),
        itl_p95_ms=_pct(itl, 0.95),
        ttft_p99_ms=_pct(ttft, 0.99),
        itl_p99_ms=_pct(itl, 0.99),
        cp_cpu_ms_per_token=cpu * 1000 / tokens if cpu_pids and tokens else None,
        cp_split_ms_per_token=[c * 1000 / tokens for c in each] if cpu_pids and tokens else None,
        ttft_split_ms=None if split is None else split[0],
        early_share=None if split is None else split[1],
        server_calls_per_prompt={op: n / prompts for op, n in calls.most_common() if n > 0}
        if metrics_port is not None and prompts
        else None,
        persistence_per_prompt=persistence / prompts
        if metrics_port is not None and prompts
        else None,
    )
    return lv


TTFT_PARTS = ("queued", "encode", "prefill", "first delta")


async def _outcomes(
    client: Client, since: datetime, prompt_host: str, run_wf_id: str
) -> list[PromptOutcome]:
    """The outcomes of the prompts admitted since ``since``: their prompt workflows'
    results, or what the run kept of its run-hosted ones (DECISIONS 66)."""
    got: list[PromptOutcome] = []
    if prompt_host == "run":
        run_id = names.run_id_from_workflow_id(run_wf_id) or 0
        run = RunHandle(client, run_id, direct_text=False)
        state = await run.snapshot()
        since_ms = since.timestamp() * 1000
        for rid in {p.request_id for p in finished_prompts(state, 64)}:
            with contextlib.suppress(Exception):
                served = await run.served(rid)
                if served is not None and served.admitted_ms >= since_ms:
                    got.append(served.outcome)
        return got
    stamp = since.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    query = f"WorkflowType = '{names.PROMPT_WORKFLOW}' AND StartTime > '{stamp}'"
    async for wf in client.list_workflows(query):
        with contextlib.suppress(Exception):
            got.append(await client.get_workflow_handle(wf.id, result_type=PromptOutcome).result())
    return got


async def ttft_split(
    client: Client, since: datetime, prompt_host: str, run_wf_id: str
) -> tuple[list[float], float] | None:
    """The medians of where the head node says the prompts' first-token time went, from
    the outcomes of the prompts admitted since ``since`` (the rest of the TTFT is
    admission: the gateway, the run's Update, the prompt workflow's start where there is
    one, and the generate activity's dispatch), and the share of them started early."""
    parts: list[list[float]] = [[] for _ in TTFT_PARTS]
    early = 0
    for got in await _outcomes(client, since, prompt_host, run_wf_id):
        if got.timing is not None and got.queued_ms is not None:
            t = got.timing
            early += t.early_ms is not None
            for acc, v in zip(
                parts,
                (got.queued_ms, t.encode_ms, t.prefill_ms, t.first_delta_ms),
                strict=True,
            ):
                acc.append(v)
    if not parts[0]:
        return None
    return [_pct(p, 0.5) or 0.0 for p in parts], early / len(parts[0])


def context_of(args: argparse.Namespace) -> int:
    """A prompt's context on both servers: a completion's prompt and tokens, or a chat
    turn's ~512-token system prompt, question and reply."""
    return 1024 if args.workload == "chat" else 512


def gateway_env(address: str, tmp: Path, text: str) -> dict[str, str]:
    """The gateway's environment: beside the worker (its state directory, so its edge
    secret: prompts' text straight from the head node, DECISIONS 63), or without the
    secret (text through Temporal)."""
    env = {k: v for k, v in os.environ.items() if k != "MVP_EDGE_SECRET"}
    env["TEMPORAL_ADDRESS"] = address
    env["MVP_STATE_DIR"] = str(tmp if text == "direct" else tmp / "no-secret-here")
    return env


async def bench_run(args: argparse.Namespace, stages: int, tmp: Path) -> list[Level]:
    """One run of ``stages`` stages through the gateway, every level."""
    top = max(args.levels)
    docker = args.provider == "docker"
    server = start_dev_server(
        str(tmp / f"t{stages}.db"),
        log_file=str(tmp / "temporal.log"),
        ip="0.0.0.0" if docker else "127.0.0.1",  # containers reach it on their gateway
    )
    worker_log = tmp / f"orchestrator-{stages}.log"
    worker = start_worker(server.address, tmp, worker_log, {names.REAPER_INTERVAL_ENV: "0"})
    gateway: subprocess.Popen[bytes] | None = None
    handle = None
    run_id = RUN_ID + stages
    try:
        await asyncio.to_thread(_wait_for, worker_log, "worker ready", worker, 60)
        client = await connect(server.address)
        request = RunRequest.model_validate(
            {
                "model": {"bundled": DEFAULT_BUNDLED},
                "pipeline_stages": stages,
                "max_active_prompts": top,
                "prompt_host": args.prompt_host,
                "layer_split": args.layer_split,
                "prompt_queue_capacity": 8,
                "max_context": context_of(args),
                "provider": args.provider,
                "docker": {"cpus": args.cpus} if docker else {},
                "engine": {"threads": args.threads} if args.threads else {},
            }
        )
        handle = (await RunHandle.start(client, run_id, request)).workflow
        while True:
            state = await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)
            if state.phase is RunPhase.PROMPT_READY:
                break
            if state.stopping:
                raise RuntimeError(f"run stopped before prompt-ready: {state.first_fault}")
            await asyncio.sleep(0.1)
        port = _free_port()
        gw_log = tmp / f"gateway-{stages}.log"
        with open(gw_log, "wb") as sink:
            gateway = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "workers.gateway.main",
                    "--workflow-id",
                    names.run_workflow_id(run_id),
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--log-level",
                    "warning",
                ],
                env=gateway_env(server.address, tmp, args.text),
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        await asyncio.to_thread(_wait_for, gw_log, "is prompt-ready", gateway, 60)
        oai = AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600
        )
        model = (await oai.models.list()).data[0].id
        pids = [server.process.pid, worker.pid, gateway.pid]
        await one_stream(oai, model, PROMPTS[0], 8)  # warm-up
        # The control plane's cost with nothing generating: pollers, timers, heartbeats
        # of the run's long-lived activities (a floor under every level's per-token CPU).
        each0 = [_cpu_s([pid]) for pid in pids]
        calls0 = server_calls(server.metrics_port)
        await asyncio.sleep(IDLE_S)
        rest = [(_cpu_s([pid]) - c0) * 1000 / IDLE_S for pid, c0 in zip(pids, each0, strict=True)]
        calls = server_calls(server.metrics_port)
        calls.subtract(calls0)
        REST_CALLS.clear()
        REST_CALLS.update({op: n / IDLE_S for op, n in calls.items() if n > 0})
        NOTES.append(
            f"{stages} stage(s), at rest: the dev server per second: "
            f"{calls.pop('persistence', 0) / IDLE_S:.1f} database requests; calls "
            + ", ".join(f"{op} {n / IDLE_S:.2f}" for op, n in calls.most_common() if n > 0)
        )
        print(NOTES[-1], file=sys.stderr, flush=True)
        NOTES.append(
            f"{stages} stage(s), {args.provider}: the control plane at rest (a prompt-ready run, "
            f"no prompt) uses {sum(rest):.0f} ms CPU per second ("
            + " + ".join(f"{r:.0f}" for r in rest)
            + "); a level's per-token figure includes that floor over its wall time."
        )
        print(NOTES[-1], file=sys.stderr, flush=True)
        out: list[Level] = []
        label = f"mvp ({args.text} text)"
        if docker:
            label = f"mvp ({args.text} text, docker" + (
                f" --cpus {args.cpus:g})" if args.cpus else ")"
            )
        if args.threads:
            label = label[:-1] + f", {args.threads} engine thread(s))"
        if args.prompt_host == "workflow":
            label = label[:-1] + ", a prompt workflow each)"
        if args.workload == "chat":
            label = label[:-1] + ", chat with a shared system prompt)"
        for c in [0, *args.levels]:
            try:
                got = await level(
                    oai,
                    model,
                    c,
                    args,
                    pids,
                    server=label,
                    stages=stages,
                    client=client,
                    metrics_port=server.metrics_port,
                )
            except Exception as err:  # a level that fails is reported, the rest skipped
                print(f"{label}, {stages} stage(s), level {c}: {err!r}", file=sys.stderr)
                break
            print(_row(got), file=sys.stderr, flush=True)
            if got.ttft_split_ms is not None:
                what = f"{got.concurrency} at once" if got.concurrency else "one after another"
                NOTES.append(
                    f"{stages} stage(s), {what}: TTFT p50 {_ms(got.ttft_p50_ms)} ms; medians of "
                    + ", ".join(
                        f"{n} {v:.0f}" for n, v in zip(TTFT_PARTS, got.ttft_split_ms, strict=True)
                    )
                    + " ms (the rest is admission: the gateway, the Update, "
                    + ("" if args.prompt_host == "run" else "the prompt workflow's start, ")
                    + "the activity's dispatch); "
                    + f"{(got.early_share or 0) * 100:.0f}% started early."
                )
                print(NOTES[-1], file=sys.stderr, flush=True)
            if got.server_calls_per_prompt is not None:
                what = f"{got.concurrency} at once" if got.concurrency else "one after another"
                NOTES.append(
                    f"{stages} stage(s), {what}: the dev server per prompt: "
                    f"{got.persistence_per_prompt:.1f} database requests; calls "
                    + ", ".join(f"{op} {n:.1f}" for op, n in got.server_calls_per_prompt.items())
                    + " (long polls included: a poll answered or timed out)."
                )
                print(NOTES[-1], file=sys.stderr, flush=True)
            out.append(got)
        await oai.close()
        return out
    finally:
        if gateway is not None:
            gateway.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                gateway.wait(15)
        if handle is not None:
            with contextlib.suppress(Exception):
                await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
                async with asyncio.timeout(60):
                    await handle.result()
        stop_process(worker, 15)
        server.stop()


async def bench_llama(args: argparse.Namespace, tmp: Path) -> list[Level]:
    """The same levels against ``llama-server -np c`` (a fresh server per level)."""
    model_path = str(fetch_bundled(DEFAULT_BUNDLED))
    out: list[Level] = []
    for c in [0, *args.levels]:
        slots = max(c, 1)
        port = _free_port()
        log = tmp / f"llama-server-{c}.log"
        with open(log, "wb") as sink:
            proc = subprocess.Popen(
                [
                    args.llama_server,
                    "-m",
                    model_path,
                    "-np",
                    str(slots),
                    "-t",
                    str(LLAMA_THREADS),
                    "-c",
                    str(context_of(args) * slots),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        # retries: llama-server may close a kept-alive connection just as the next
        # request reuses it ("Server disconnected without sending a response")
        oai = AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=2, timeout=600
        )
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    model = (await oai.models.list()).data[0].id
                    await one_stream(oai, model, PROMPTS[0], 8)  # warm-up
                    break
                except Exception:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"llama-server did not start: {log.read_text(errors='replace')[-1500:]}"
                        ) from None
                    await asyncio.sleep(0.5)
            name = "llama-server" + (" (chat)" if args.workload == "chat" else "")
            got = await level(oai, model, c, args, [], server=name, stages=1)
            print(_row(got), file=sys.stderr, flush=True)
            out.append(got)
        finally:
            await oai.close()
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _row(lv: Level) -> str:
    what = f"{SEQUENTIAL} one after another" if lv.concurrency == 0 else f"{lv.concurrency} at once"
    cpu = "-" if lv.cp_cpu_ms_per_token is None else f"{lv.cp_cpu_ms_per_token:.2f}"
    if lv.cp_split_ms_per_token:
        cpu += " (" + " + ".join(f"{c:.1f}" for c in lv.cp_split_ms_per_token) + ")"
    return (
        f"| {lv.server} | {lv.stages} | {what} | {lv.aggregate_tok_s:.1f} | "
        f"{_ms(lv.ttft_p50_ms)} / {_ms(lv.ttft_p95_ms)} / {_ms(lv.ttft_p99_ms)} | "
        f"{lv.itl_p50_ms or 0:.1f} / {lv.itl_p95_ms or 0:.1f} / {lv.itl_p99_ms or 0:.1f} | "
        f"{cpu} | {lv.tokens} |"
    )


def table(levels: list[Level], args: argparse.Namespace) -> str:
    lines = [
        f"SmolLM2-135M Q4_1, {os.cpu_count()} cores, {args.tokens}-token greedy streams, "
        f"{args.rounds} round(s) per level; engine kernel "
        f"{os.environ.get('MVP_ENGINE_KERNEL', 'auto')}",
        "",
        "| server | stages | streams | aggregate tok/s | TTFT p50 / p95 / p99 ms "
        "| ITL p50 / p95 / p99 ms "
        "| control-plane CPU ms/token (dev server + worker + gateway) | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(lv) for lv in levels]
    lines += ["", *NOTES] if NOTES else []
    return "\n".join(lines)


async def bench(args: argparse.Namespace) -> list[Level]:
    tmp = Path(tempfile.mkdtemp(prefix="mvp-bench-serve-"))
    print(f"bench state and logs: {tmp}", file=sys.stderr)
    levels: list[Level] = []
    for stages in args.stages:
        levels += await bench_run(args, stages, tmp)
    if args.llama_server:
        levels += await bench_llama(args, tmp)
    return levels


def plot(levels: list[Level], path: Path) -> None:
    """Aggregate tok/s and TTFT p50 against concurrent streams, one line per series."""
    fig, (rate, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    series: dict[str, list[Level]] = {}
    for lv in levels:
        if lv.concurrency:
            name = (
                f"{lv.server}, {lv.stages} stage(s)" if lv.server.startswith("mvp") else lv.server
            )
            series.setdefault(name, []).append(lv)
    for name, rows in series.items():
        xs = [r.concurrency for r in rows]
        rate.plot(xs, [r.aggregate_tok_s for r in rows], marker="o", label=name)
        ttft.plot(xs, [r.ttft_p50_ms or 0 for r in rows], marker="o", label=name)
    rate.set(xlabel="concurrent streams", ylabel="aggregate tok/s", title="throughput")
    ttft.set(xlabel="concurrent streams", ylabel="TTFT p50 (ms)", title="time to first token")
    for ax in (rate, ttft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llama-server", default=None, metavar="PATH")
    p.add_argument(
        "--text",
        choices=["direct", "temporal"],
        default="direct",
        help="how the gateway reads prompts' text: from the head node (beside the worker, "
        "the default) or through Temporal (a gateway without the deployment's secret)",
    )
    p.add_argument("--provider", choices=["process", "docker"], default="process")
    p.add_argument(
        "--prompt-host",
        choices=["workflow", "run"],
        default="run",
        help="where the run serves its prompts (prompt_host, DECISIONS 66): in the run's "
        "own Update (the default here: the serving examples' choice) or a PromptWorkflow each",
    )
    p.add_argument(
        "--layer-split",
        choices=["even", "balanced"],
        default="even",
        help="how the stages get their layers (layer_split, DECISIONS 67): the same number "
        "each (the default, as docs/benchmarks/serve.md's tables ran), or even work per "
        "token with the output head counted (the pipeline serving example's choice)",
    )
    p.add_argument(
        "--cpus",
        type=float,
        default=None,
        help="docker: each node container's CPU limit (docker.cpus), e.g. 1 to see a "
        "pipeline fill: 2 one-CPU stages against 1",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="engine threads per node (engine.threads; default: the node's own choice, "
        "DECISIONS 20)",
    )
    p.add_argument(
        "--workload",
        choices=["completion", "chat"],
        default="completion",
        help="completions of short distinct prompts (the default), or chat turns that all "
        "start with one shared ~512-token system prompt (prefix reuse, DECISIONS 91)",
    )
    p.add_argument("--report", type=Path, default=None, metavar="DIR")
    args = p.parse_args()
    if args.cpus is not None and args.provider != "docker":
        p.error("--cpus is a docker setting: add --provider docker")
    if not 1 <= min(args.levels) or max(args.levels) > MAX_ACTIVE_PROMPTS:
        p.error(f"--levels: each from 1 to {MAX_ACTIVE_PROMPTS} (a run's max_active_prompts)")
    levels = asyncio.run(bench(args))
    text = table(levels, args)
    print(text)
    if args.report is not None:
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / "serve.md").write_text(f"# Serving many streams\n\n{text}\n")
        (args.report / "serve.json").write_text(
            json.dumps([asdict(lv) for lv in levels], indent=2) + "\n"
        )
        plot(levels, args.report / "serve.png")


if __name__ == "__main__":
    main()
