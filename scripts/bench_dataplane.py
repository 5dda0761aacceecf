"""Data-plane benchmark (not a test): the pipeline without Temporal.

Stages 1..N-1 each run in their own process (like nodes: StageLink over authenticated
loopback TCP, placed on the token-path cores at the token-path priority); stage 0 and the
driver run here, as on the head node. Paired against the same stages run one after another
in one thread, in interleaved rounds. Read next to scripts/bench_pipeline.py: the gap
between the two is what the control plane (Temporal server, streams, event loops) costs a
pipeline on a shared host.

    .venv/bin/python scripts/bench_dataplane.py [--stages 2 3] [--tokens 128] [--rounds 7]
        [--address-layout fixed|randomized]
"""

from __future__ import annotations

# First, before any other import maps a library: the node processes' address layout.
from workers.node.layout import map_native_libraries, randomized

if not randomized():
    map_native_libraries()

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection

from mvp_core.models import EdgeKind
from mvp_core.planner import plan_edges, stage_layer_ranges
from mvp_io.model_store import DEFAULT_BUNDLED, fetch_bundled
from workers.node.affinity import Placement, compute_set
from workers.node.dataplane import DataPlaneServer, EdgeGroup, EdgeSpec
from workers.node.engine import (
    EngineOptions,
    SamplingParams,
    generate,
    load_stage,
    read_model_facts,
)
from workers.node.pipeline import Driver, Endpoint, StageLink

PROMPT_IDS = [6403, 1980, 253, 655]  # "Once upon a time"
TOKEN = "bench-edge-token-0123456789abcdef"
MAX_SEQ = 512


def _placement() -> Placement:
    return Placement(compute_set("auto"), nice=-5)


def _link(
    path: str,
    stages: int,
    index: int,
    server: DataPlaneServer,
    group: EdgeGroup,
    consumer: Endpoint,
    ready: threading.Semaphore,
    faults: list[str],
) -> StageLink:
    facts = read_model_facts(path)
    layers = stage_layer_ranges(facts.block_count, stages)[index]
    edges = plan_edges(stages, MAX_SEQ, facts.embedding_length)
    inbound = next(e for e in edges if e.dst_stage == index)
    outbound = next(e for e in edges if e.src_stage == index)
    stage = load_stage(path, layers.start, layers.end, EngineOptions(device="cpu", threads=1))
    return StageLink(
        stage,
        server=server,
        group=group,
        inbound=EdgeSpec.from_plan(inbound),
        outbound=EdgeSpec.from_plan(outbound),
        consumer=consumer,
        token=TOKEN,
        max_seq_len=MAX_SEQ,
        stop_ids=set(),
        connect_timeout_s=30,
        on_ready=ready.release,
        on_fault=faults.append,
        placement=_placement(),
    )


def node(path: str, stages: int, index: int, conn: Connection) -> None:
    """Stage `index` in its own process: report the port, get the consumer's, serve."""
    sys.setswitchinterval(0.0001)
    server = DataPlaneServer()
    conn.send(server.port)
    consumer = Endpoint(server.host, conn.recv())
    _placement().confine_others()
    faults: list[str] = []
    link = _link(
        path,
        stages,
        index,
        server,
        EdgeGroup(f"stage{index}"),
        consumer,
        threading.Semaphore(0),
        faults,
    )
    link.start()
    conn.recv()  # stop
    link.close()
    server.close()


def pipeline_rate(driver: Driver, tokens: int, request_id: int) -> float:
    out: list[int] = []
    t0 = time.perf_counter()
    with _placement().applied():
        driver.run(
            request_id,
            PROMPT_IDS,
            SamplingParams(),
            max_new_tokens=tokens,
            max_seq_len=MAX_SEQ,
            on_token=lambda token, _: out.append(token),
            should_stop=lambda: False,
        )
    return len(out) / (time.perf_counter() - t0)


def main(args: argparse.Namespace) -> None:
    sys.setswitchinterval(0.0001)
    path = str(fetch_bundled(DEFAULT_BUNDLED))
    facts = read_model_facts(path)
    rows = []
    for n in args.stages:
        ctx = mp.get_context("spawn")
        pipes, procs, ports = [], [], []
        for i in range(1, n):
            here, there = ctx.Pipe()
            p = ctx.Process(target=node, args=(path, n, i, there), daemon=True)
            p.start()
            pipes.append(here)
            procs.append(p)
            ports.append(here.recv())
        server = DataPlaneServer()
        for i, conn in enumerate(pipes):  # stage i+1 sends to stage i+2, the last to the driver
            conn.send(ports[i + 1] if i + 1 < len(ports) else server.port)
        Placement(compute_set("auto")).confine_others()
        ready = threading.Semaphore(0)
        faults: list[str] = []
        group = EdgeGroup("head")
        head = _link(path, n, 0, server, group, Endpoint(server.host, ports[0]), ready, faults)
        edges = plan_edges(n, MAX_SEQ, facts.embedding_length)
        spec = {e.kind: EdgeSpec.from_plan(e) for e in edges if e.kind is not EdgeKind.ACTIVATION}
        driver = Driver(
            server=server,
            group=group,
            token_in=spec[EdgeKind.TOKEN_IN],
            token_out=spec[EdgeKind.TOKEN_OUT],
            token=TOKEN,
            connect_timeout_s=30,
            record_timeout_s=30,
            on_ready=ready.release,
            on_fault=faults.append,
        )
        head.start()
        driver.start()
        for _ in range(2):
            if not ready.acquire(timeout=60):
                raise RuntimeError(f"pipeline did not come up: {faults}")
        layers = stage_layer_ranges(facts.block_count, n)
        local = [
            load_stage(path, r.start, r.end, EngineOptions(device="cpu", threads=1)) for r in layers
        ]
        piped, seq = [], []
        try:
            pipeline_rate(driver, 16, 0)  # warm-up
            for r in range(args.rounds):
                piped.append(pipeline_rate(driver, args.tokens, r + 1))
                t0 = time.perf_counter()
                with _placement().applied():
                    k = len(
                        list(
                            generate(
                                local,
                                PROMPT_IDS,
                                max_new_tokens=args.tokens,
                                max_seq_len=MAX_SEQ,
                                sampling=SamplingParams(),
                                stop_ids=set(),
                            )
                        )
                    )
                seq.append(k / (time.perf_counter() - t0))
        finally:
            for s in local:
                s.close()
            for conn in pipes:
                conn.send("stop")
            for p in procs:
                p.join(10)
            head.close()
            group.close()
            server.close()
        ratio = statistics.median(a / b for a, b in zip(piped, seq, strict=True))
        per_token = 1 / statistics.median(piped) - 1 / statistics.median(seq)
        rows.append(
            (n, statistics.median(piped), statistics.median(seq), ratio, per_token / (n + 1) * 1000)
        )
    print(
        f"\nSmolLM2-135M Q4_1, {os.cpu_count()} cores, {args.tokens}-token greedy decode, "
        f"no Temporal, median of {args.rounds} interleaved rounds\n"
    )
    print("| stages | node processes tok/s | one thread tok/s | ratio (paired) | per-hop ms |")
    print("|---|---|---|---|---|")
    for n, a, b, ratio, hop in rows:
        print(f"| {n} | {a:.1f} | {b:.1f} | {ratio:.3f}x | {hop:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--address-layout",
        choices=["fixed", "randomized"],
        default="fixed",
        help="as engine.address_layout (fixed: what a run with 2+ local nodes gets)",
    )
    args = parser.parse_args()
    from workers.node.layout import ensure_layout

    if (note := ensure_layout(args.address_layout)) is not None:  # may re-exec this script
        print(note)
    main(args)
