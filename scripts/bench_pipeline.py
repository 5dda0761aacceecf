"""Pipeline benchmark (not a test): 1, 2 and 3 stages of SmolLM2 on this host through the
whole product (dev server, orchestrator worker, node processes or containers), with an
optional sweep of one-way edge delays on the multi-stage runs.

A 1-stage run (the baseline) stays up for the whole session. Then, for each delay of
--delays-ms, one run per multi-stage count is started (timing workflow start ->
prompt-ready) and prompts go to the baseline and those runs in interleaved rounds, so
slow drift of a shared machine hits every configuration alike; the ratio to 1 stage is
taken per round and its median reported. Those runs are shut down before the next delay.

- decode tok/s of the engine loop (Done.tokens_generated / Done.elapsed_ms) and as seen
  by a streaming client, on greedy prompts of --tokens tokens
- per-hop overhead (undelayed runs): (1/pipeline tok/s - 1/in-process tok/s of the same
  stages run one after another in one thread) divided by the records each token crosses
  (N+1 edges, the local token-in included)
- edge delay d (MVP_FAULT_EDGE_DELAY_MS through the harness faults file; each node fronts
  its data-plane listener with workers/node/dataplane/delay_proxy.py and advertises that): a
  token of an N-stage run crosses N node-to-node edges (N-1 activation edges and the
  token-out edge back to the head; the head's token-in is local, not delayed), so decode
  is bounded by 1 / (compute_per_token + N * d), compute_per_token = 1 / (1-stage tok/s)
  measured in the same rounds. "added per crossing": the per-token time over the 1 stage
  of the same round, at d minus at 0, divided by N; a faithful delay line keeps it near d.
  A 1-stage run has no edges (direct mode): the delay is never applied to it.
- RSS of each node process (process provider)
- time to first token, in parts (``ttft_breakdown_ms``, medians over the rounds), from the
  client's clock and the prompt workflow's history (one machine, one wall clock):
  admission = the client sends submit_prompt -> the run accepted the Update (``on_admitted``);
  dispatch = accepted -> the generate activity started on the head node (the history's
  ActivityTaskStarted; dispatch_to_scheduled and dispatch_schedule_to_start split it at
  ActivityTaskScheduled); prefill = that start -> the node's first text reached the prompt
  workflow (its first stream-publish signal: encode, the prompt through every stage, the
  first token, detokenize and the signal RPC); first delta = that signal -> the client has
  the first TextDelta (the workflow task that takes the signal, the client's long poll).
  Where the head node reports its own timing (PromptOutcome.timing: encode, prefill to the
  first token sampled, that token to its text published), those medians come along as
  node_encode_ms, node_prefill_ms and node_first_delta_ms.

    .venv/bin/python scripts/bench_pipeline.py [--provider process|docker] [--stages 1,2,3]
        [--delays-ms 0,1,5,20] [--tokens 64] [--rounds 3] [--json PATH]

Docker: the dev server listens on 0.0.0.0 (containers reach it through their network's
gateway) and the orchestrator worker inherits DOCKER_HOST. The bench's worker runs no
reaper sweeps (MVP_REAPER_INTERVAL_S=0 unless set): a shared daemon may hold others' nodes.
A run whose teardown fails after its figures were taken is reported, not fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
from temporalio.api.enums.v1 import EventType

from activities.providers.base import TEST_FAULTS_FILE_ENV
from mvp_core import names
from mvp_core.models import (
    Done,
    Fault,
    PromptOutcome,
    RequestShutdown,
    RunPhase,
    RunRequest,
    SubmitPrompt,
    TextDelta,
)
from mvp_core.planner import stage_layer_ranges
from mvp_core.run_state import RunState
from mvp_io.model_store import DEFAULT_BUNDLED, fetch_bundled
from temporal.client import RunHandle
from temporal.connect import TemporalSettings, connect, local_server_env
from temporal.devserver import start_dev_server
from workers.node.affinity import Placement, compute_set
from workers.node.engine import EngineOptions, SamplingParams, generate, load_stage
from workers.node.runtime import default_threads

PROMPT_IDS = [6403, 1980, 253, 655]  # "Once upon a time"
ADDRESS_LAYOUT = "auto"  # engine.address_layout of every run (--address-layout)
EDGE_DELAY_KNOB = "MVP_FAULT_EDGE_DELAY_MS"
FIRST_RUN_ID = 950
PUBLISH_SIGNAL = "__temporal_workflow_stream_publish"  # temporalio.contrib.workflow_streams
BREAKDOWN_PARTS = ("admission", "dispatch", "prefill", "first_delta")
NODE_PARTS = ("encode_ms", "prefill_ms", "first_delta_ms")  # PromptOutcome.timing, if any


@dataclass
class Sample:
    engine: float  # tok/s of the engine loop
    client: float  # tok/s seen by the streaming client
    first_ms: float  # first text delta
    request_id: int = -1
    sent_at: float = 0.0  # wall clock (time.time()): submit_prompt sent
    admitted_at: float = 0.0  # the run accepted the Update
    first_at: float = 0.0  # the client has the first TextDelta
    parts_ms: dict[str, float] | None = None  # from the prompt workflow's history


@dataclass
class Config:
    stages: int
    delay_ms: float
    run_id: int
    handle: Any = None
    ready_s: float = 0.0
    state: RunState | None = None
    samples: list[Sample] = field(default_factory=list)
    paired: list[Sample] = field(default_factory=list)  # the 1-stage sample of each round
    rss_mib: list[float] = field(default_factory=list)

    @property
    def crossings(self) -> int:
        """Node-to-node edges a token crosses: N-1 activation edges and token-out."""
        return self.stages if self.stages > 1 else 0

    @property
    def engine(self) -> float:
        return statistics.median(s.engine for s in self.samples)


def in_process(path: str, stages: int, tokens: int, threads: int) -> tuple[float, float]:
    """The same stages one after another in one thread, placed like a node's token path:
    decode tok/s and the time to the first token (prefill and the first sample, ms)."""
    layers = stage_layer_ranges(30, stages)
    loaded = [
        load_stage(path, r.start, r.end, EngineOptions(device="cpu", threads=threads))
        for r in layers
    ]
    try:
        rates = []
        firsts = []
        with Placement(compute_set("auto"), nice=-5).applied():
            for _ in range(3):
                t0 = time.perf_counter()
                n = 0
                for _token in generate(
                    loaded,
                    PROMPT_IDS,
                    max_new_tokens=tokens,
                    max_seq_len=512,
                    sampling=SamplingParams(),
                    stop_ids=set(),
                ):
                    if n == 0:
                        firsts.append((time.perf_counter() - t0) * 1000)
                    n += 1
                rates.append(n / (time.perf_counter() - t0))
        return statistics.median(rates), statistics.median(firsts)
    finally:
        for s in loaded:
            s.close()


def run_request(stages: int, provider: str) -> RunRequest:
    node_env = dict(kv.split("=", 1) for kv in os.environ.get("BENCH_NODE_ENV", "").split() if kv)
    return RunRequest.model_validate(
        {
            "model": {"bundled": DEFAULT_BUNDLED},
            "pipeline_stages": stages,
            "provider": provider,
            "engine": {"address_layout": ADDRESS_LAYOUT},
            "node_env": node_env,
        }
    )


async def start_run(client: Any, cfg: Config, provider: str) -> None:
    req = run_request(cfg.stages, provider)
    t0 = time.perf_counter()
    cfg.handle = await client.start_workflow(
        names.RUN_WORKFLOW,
        req,
        id=names.run_workflow_id(cfg.run_id),
        task_queue=names.ORCHESTRATOR_TASK_QUEUE,
    )
    while (
        state := await cfg.handle.query(names.QUERY_SNAPSHOT, result_type=RunState)
    ).phase != RunPhase.PROMPT_READY:
        if state.stopping:
            raise RuntimeError(
                f"run {cfg.run_id} ({cfg.stages} stages, {cfg.delay_ms} ms) stopped before "
                f"prompt-ready: {state.first_fault}"
            )
        await asyncio.sleep(0.05)
    cfg.ready_s = time.perf_counter() - t0
    cfg.state = state


async def one_prompt(client: Any, run_id: int, request_id: int, tokens: int) -> Sample:
    start = time.perf_counter()
    sent_at = time.time()
    admitted_at = 0.0
    first = None
    first_at = 0.0
    done = None

    def admitted() -> None:
        nonlocal admitted_at
        admitted_at = time.time()

    prompt = SubmitPrompt(request_id=request_id, prompt_text="Once upon a time", max_tokens=tokens)
    async for ev in RunHandle(client, run_id).stream(prompt, on_admitted=admitted):
        if isinstance(ev, TextDelta) and first is None:
            first = time.perf_counter()
            first_at = time.time()
        elif isinstance(ev, Done):
            done = ev
        elif isinstance(ev, Fault):
            raise RuntimeError(f"run {run_id} prompt {request_id} faulted: {ev}")
    assert done is not None and first is not None
    return Sample(
        done.tokens_generated / (done.elapsed_ms / 1000),
        done.tokens_generated / (time.perf_counter() - start),
        (first - start) * 1000,
        request_id,
        sent_at,
        admitted_at,
        first_at,
    )


async def ttft_parts(client: Any, run_id: int, sample: Sample) -> dict[str, float] | None:
    """The sample's time to first token in parts (ms; see the module doc), or None when its
    prompt workflow or one of the events is not found."""
    workflow_id = None
    for _ in range(50):  # a closed prompt reaches visibility a moment after it ends
        workflow_id = await RunHandle(client, run_id).find_prompt(sample.request_id)
        if workflow_id is not None:
            break
        await asyncio.sleep(0.1)
    if workflow_id is None:
        return None
    handle = client.get_workflow_handle(workflow_id, result_type=PromptOutcome)
    history = await handle.fetch_history()
    started = published = scheduled = None
    for event in history.events:
        at = event.event_time.ToMicroseconds() / 1e6
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED and scheduled is None:
            scheduled = at
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED and started is None:
            started = at
        elif (
            event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
            and event.workflow_execution_signaled_event_attributes.signal_name == PUBLISH_SIGNAL
            and published is None
        ):
            published = at
    if started is None or published is None or not sample.admitted_at:
        return None
    parts = {
        "admission": (sample.admitted_at - sample.sent_at) * 1000,
        "dispatch": (started - sample.admitted_at) * 1000,
        "prefill": (published - started) * 1000,
        "first_delta": (sample.first_at - published) * 1000,
    }
    if scheduled is not None:  # dispatch's two halves: the run's and the prompt's workflow
        # tasks up to scheduling the generate, then the head node's poll taking it
        parts["dispatch_to_scheduled"] = (scheduled - sample.admitted_at) * 1000
        parts["dispatch_schedule_to_start"] = (started - scheduled) * 1000
    # The head node's own account, where its PromptOutcome carries one (``timing``).
    outcome = await handle.result()
    timing = getattr(outcome, "timing", None)
    for key in NODE_PARTS:
        value = getattr(timing, key, None)
        if isinstance(value, int | float):
            parts[f"node_{key}"] = float(value)
    return parts


def breakdown(samples: list[Sample]) -> dict[str, float] | None:
    """Medians of each part over the samples that have them, and of their sum."""
    parts = [s.parts_ms for s in samples if s.parts_ms is not None]
    if not parts:
        return None
    out = {k: statistics.median(p[k] for p in parts) for k in BREAKDOWN_PARTS}
    extra = ["dispatch_to_scheduled", "dispatch_schedule_to_start"]
    for key in [*extra, *(f"node_{k}" for k in NODE_PARTS)]:
        values = [p[key] for p in parts if key in p]
        if values:
            out[key] = statistics.median(values)
    out["total"] = statistics.median(sum(p[k] for k in BREAKDOWN_PARTS) for p in parts)
    out["client_ttft"] = statistics.median(s.first_ms for s in samples if s.parts_ms is not None)
    out["samples"] = len(parts)
    return out


def node_rss(cfg: Config) -> list[float]:
    """RSS of the run's node processes (none for containers: no host pid)."""
    out = []
    for node in cfg.state.nodes if cfg.state else []:
        if node.handle and node.handle.pid:
            try:
                out.append(psutil.Process(node.handle.pid).memory_info().rss / 2**20)
            except psutil.Error:
                pass
    return out


async def shutdown(cfgs: list[Config], timeout_s: float = 90.0) -> list[str]:
    """Ask each run to shut down and wait for it; a run that fails its teardown (its
    figures are taken by then) is reported, not raised: every run still gets its stop."""
    problems = []
    for cfg in cfgs:
        if cfg.handle is not None:
            try:
                await cfg.handle.signal(
                    names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=cfg.run_id)
                )
            except Exception as err:
                problems.append(f"run {cfg.run_id}: shutdown signal: {err}")
    for cfg in cfgs:
        if cfg.handle is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    await cfg.handle.result()
            except Exception as err:
                cause = getattr(err, "cause", None)
                problems.append(f"run {cfg.run_id} ({cfg.stages} stages): {err}: {cause or ''}")
            cfg.handle = None
    for p in problems:
        print(f"warning: {p}", file=sys.stderr)
    return problems


async def measure(
    args: argparse.Namespace, base: Config, groups: list[list[Config]], idle: list[Config]
) -> list[str]:
    """Run the rounds; returns the runs' teardown problems."""
    tmp = tempfile.mkdtemp(prefix="mvp-bench-")
    faults_file = os.path.join(tmp, "faults.json")
    with open(faults_file, "w") as f:
        json.dump(
            {
                str(c.run_id): {EDGE_DELAY_KNOB: f"{c.delay_ms:g}"}
                for g in groups
                for c in g
                if c.delay_ms > 0
            },
            f,
        )
    docker = args.provider == "docker"
    server = start_dev_server(os.path.join(tmp, "t.db"), ip="0.0.0.0" if docker else "127.0.0.1")
    env = {
        **local_server_env(server.address),
        "MVP_STATE_DIR": tmp,
        TEST_FAULTS_FILE_ENV: faults_file,
        # No reaper sweeps from the bench's worker: a Docker daemon may hold others' nodes.
        names.REAPER_INTERVAL_ENV: os.environ.get(names.REAPER_INTERVAL_ENV, "0"),
    }
    log = open(os.path.join(tmp, "orchestrator.log"), "wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "workers.orchestrator"], env=env, stdout=log, stderr=log
    )
    print(f"bench state and logs: {tmp}", file=sys.stderr)
    live: list[Config] = []
    problems: list[str] = []
    request = 0
    try:
        client = await connect(settings=TemporalSettings.local(server.address))
        await asyncio.sleep(2)
        live.append(base)
        await start_run(client, base, args.provider)
        await one_prompt(client, base.run_id, request, 16)  # the first prompt pays one-time costs
        base.rss_mib = node_rss(base)
        for cfg in idle:  # diagnostic runs that stay idle through the rounds
            live.append(cfg)
            await start_run(client, cfg, args.provider)
        for group in groups:
            for cfg in group:
                live.append(cfg)
                await start_run(client, cfg, args.provider)
                print(
                    f"  {cfg.stages} stages, {cfg.delay_ms:g} ms: prompt-ready in {cfg.ready_s:.1f} s",
                    file=sys.stderr,
                )
            for cfg in group:
                request += 1
                await one_prompt(client, cfg.run_id, request, 16)
            for _ in range(args.rounds):
                request += 1
                b = await one_prompt(client, base.run_id, request, args.tokens)
                base.samples.append(b)
                for cfg in group:
                    s = await one_prompt(client, cfg.run_id, request, args.tokens)
                    cfg.samples.append(s)
                    cfg.paired.append(b)
            for cfg in group:
                cfg.rss_mib = node_rss(cfg)
                for sample in cfg.samples:
                    sample.parts_ms = await ttft_parts(client, cfg.run_id, sample)
            problems += await shutdown(group)
            live = [c for c in live if c not in group]
        for sample in base.samples:
            sample.parts_ms = await ttft_parts(client, base.run_id, sample)
        problems += await shutdown([base, *idle])
        live = []
    finally:
        if live:  # after a failure: leave no node behind
            problems += await shutdown(live, 30)
        worker.terminate()
        worker.wait(15)
        server.stop()
        log.close()
    return problems


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(args: argparse.Namespace, base: Config, groups: list[list[Config]]) -> dict[str, Any]:
    path = str(fetch_bundled(DEFAULT_BUNDLED))
    counts = sorted({base.stages} | {c.stages for g in groups for c in g})
    measured = {
        n: in_process(path, n, args.tokens, default_threads(os.cpu_count() or 1, n)) for n in counts
    }
    local = {n: m[0] for n, m in measured.items()}
    base_eng = base.engine
    extra = {  # per-token time over the 1 stage of the same round, ms (median)
        id(c): statistics.median(
            (1 / s.engine - 1 / b.engine) * 1000 for s, b in zip(c.samples, c.paired, strict=True)
        )
        for g in groups
        for c in g
    }
    zero = {c.stages: c for g in groups for c in g if c.delay_ms == 0}
    rows = []
    for cfg in [base, *(c for g in groups for c in g)]:
        eng = cfg.engine
        n, d = cfg.stages, cfg.delay_ms / 1000
        if cfg is base:
            ratios, base_here = [1.0], base_eng
        else:
            ratios = sorted(
                s.engine / b.engine for s, b in zip(cfg.samples, cfg.paired, strict=True)
            )
            base_here = statistics.median(b.engine for b in cfg.paired)
        compute_s = 1 / base_here  # the 1 stage measured in the same rounds
        bound = 1 / (compute_s + cfg.crossings * d)
        hop = (1 / eng - 1 / local[n]) / (n + 1) * 1000 if n > 1 and d == 0 else None
        added = (
            (extra[id(cfg)] - extra[id(zero[n])]) / cfg.crossings
            if n > 1 and d > 0 and n in zero
            else None
        )
        rows.append(
            {
                "provider": args.provider,
                "stages": n,
                "delay_ms": cfg.delay_ms,
                "run_id": cfg.run_id,
                "crossing_edges": cfg.crossings,
                "one_stage_tok_s_same_rounds": base_here,
                "ms_per_token_over_1_stage": extra.get(id(cfg)),
                "prompt_ready_s": cfg.ready_s,
                "engine_tok_s": eng,
                "engine_tok_s_samples": [s.engine for s in cfg.samples],
                "paired_ratio_to_1_stage": statistics.median(ratios),
                "paired_ratio_range": [ratios[0], ratios[-1]],
                "client_tok_s": statistics.median(s.client for s in cfg.samples),
                "first_delta_ms": statistics.median(s.first_ms for s in cfg.samples),
                "in_process_tok_s": local[n],
                "in_process_first_token_ms": measured[n][1],
                "bound_tok_s": bound,
                "measured_over_bound": eng / bound,
                "per_hop_overhead_ms": hop,
                "added_per_crossing_ms": added,
                "rss_mib": cfg.rss_mib,
                "ttft_breakdown_ms": breakdown(cfg.samples),
            }
        )
    print(
        f"\nSmolLM2-135M Q4_1, {os.cpu_count()} cores, provider {args.provider}, "
        f"{args.tokens}-token greedy decode, median of {args.rounds} interleaved rounds "
        f"(1 stage: {len(base.samples)}, {base_eng:.1f} tok/s); bound = 1 / (1/(1-stage tok/s "
        f"of the same rounds) + N x d)\n"
    )
    print(
        "| stages | delay ms | prompt-ready s | engine tok/s | 1 stage, same rounds | "
        "bound tok/s | measured/bound | vs 1 stage, paired (range) | client tok/s | "
        "first delta ms | in-process tok/s | per-hop overhead ms | added per crossing ms | "
        "RSS per node MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["paired_ratio_range"]
        print(
            f"| {r['stages']} | {r['delay_ms']:g} | {r['prompt_ready_s']:.1f} | "
            f"{r['engine_tok_s']:.1f} | {r['one_stage_tok_s_same_rounds']:.1f} | "
            f"{r['bound_tok_s']:.1f} | {r['measured_over_bound']:.2f} | "
            f"{r['paired_ratio_to_1_stage']:.3f}x ({lo:.2f}-{hi:.2f}) | {r['client_tok_s']:.1f} | "
            f"{r['first_delta_ms']:.0f} | {r['in_process_tok_s']:.1f} | "
            f"{fmt(r['per_hop_overhead_ms'], '.2f')} | {fmt(r['added_per_crossing_ms'], '.2f')} | "
            f"{', '.join(f'{x:.0f}' for x in r['rss_mib']) or '-'} |"
        )
    return {
        "model": f"{DEFAULT_BUNDLED}",
        "cores": os.cpu_count(),
        "provider": args.provider,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "one_stage_tok_s": base_eng,
        "configs": rows,
    }


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.replace(",", " ").split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", choices=["process", "docker"], default="process")
    parser.add_argument(
        "--stages", type=int_list, default=[1, 2, 3], help="stage counts, e.g. 1,2,3"
    )
    parser.add_argument(
        "--delays-ms",
        type=float_list,
        default=[0.0],
        help="one-way edge delays of the multi-stage runs, e.g. 0,1,5,20",
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write the figures here as JSON")
    parser.add_argument(
        "--idle-runs",
        type=int_list,
        default=[],
        help="stage counts of extra runs kept idle during the rounds, e.g. 2,3",
    )
    parser.add_argument(
        "--address-layout",
        choices=["auto", "fixed", "randomized"],
        default="auto",
        help="engine.address_layout of the runs (auto: fixed for 2+ nodes)",
    )
    args = parser.parse_args()
    if any(d < 0 for d in args.delays_ms):
        parser.error("delays must be >= 0")
    if any(n < 1 for n in args.stages):
        parser.error("stage counts must be >= 1")
    result = bench(args)
    for p in result["teardown_problems"]:
        print(f"\nteardown problem (after the figures were taken): {p}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"\nwrote {args.json}")


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Measure and return the figures (also printed as a table). ``args`` holds provider,
    stages, delays_ms, tokens, rounds, idle_runs and address_layout, as main parses them."""
    global ADDRESS_LAYOUT
    ADDRESS_LAYOUT = args.address_layout
    multi = sorted({n for n in args.stages if n >= 2})
    run_id = FIRST_RUN_ID
    base = Config(1, 0.0, run_id)  # always measured: the ratio and the bound need it
    groups: list[list[Config]] = []
    for d in dict.fromkeys(args.delays_ms):
        group = []
        for n in multi:
            run_id += 1
            group.append(Config(n, d, run_id))
        if group:
            groups.append(group)
    idle = [Config(n, 0.0, FIRST_RUN_ID + 100 + i) for i, n in enumerate(args.idle_runs)]
    problems = asyncio.run(measure(args, base, groups, idle))
    result = report(args, base, groups)
    result["teardown_problems"] = problems
    return result


if __name__ == "__main__":
    main()
