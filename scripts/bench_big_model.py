"""A hub model at size through the whole product, by stage count (issue 35; not in CI).

    python scripts/bench_big_model.py FIRST-PART.gguf [--stages 1 2 3] [--tokens 32]
        [--provider process|docker] [--cpus C] [--llama-bench PATH]

The model's files (a split model's parts beside FIRST-PART, as llama.cpp finds them)
are served by the hub stand-in (tests/helpers/hub_standin.py) on loopback. For each stage
count a fresh dev server's run, on a fresh orchestrator worker with an empty model cache,
serves it on process nodes of this host (``--provider docker``: on containers of a private
Docker daemon the script starts, each limited to its own stage's planned memory need,
``memory_per_stage``, and to ``--cpus`` CPUs), and the script reports:

- the time from the run's start to prompt-ready, in phases from the run's history:
  planning (the plan activity: headers only), start (each node's share fetched on this
  host, then its process started: the last node's), load (the last WeightsReady), ready
  (prompt-ready);
- per node: its share (MB), what its host fetched for it, its RSS after loading against
  its share + KV cache, and the stage's planned memory need;
- the hub's bytes in all against the model's size;
- decode tok/s through the system (one greedy prompt of --tokens tokens: the engine
  loop's figure, Done.tokens_generated / Done.elapsed_ms);
- with ``--llama-bench``: llama.cpp's decode (``-p 0 -n --tokens``) on the same file,
  once with each of ``--llama-threads`` (default 1 and 2), in the same run.

With ``--provider docker`` the script's dev server listens on every address (the
containers reach it through their network's gateway): run it on a host whose other
interfaces are not exposed, as the benchmark host is.

A container's memory is its cgroup's (usage less inactive file pages, as ``docker
stats`` shows it) and the most it used (the cgroup's peak, where the kernel keeps one).

Runs one after another (one model in memory at a time). Name the CPU beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: scripts/ and the packages importable
    sys.path.insert(0, str(REPO))

from mvp_core import names  # noqa: E402
from mvp_core.models import (  # noqa: E402
    Done,
    RequestShutdown,
    RunPhase,
    RunRequest,
    SubmitPrompt,
)
from mvp_core.run_state import RunState  # noqa: E402
from mvp_io.gguf_files import open_model  # noqa: E402
from scripts.host_cpu import cpu_model  # noqa: E402
from temporal.client import RunHandle  # noqa: E402
from temporal.connect import connect, local_server_env  # noqa: E402
from temporal.devserver import start_dev_server  # noqa: E402
from tests.helpers.hub_standin import HubStandin  # noqa: E402

HUB_REPO = "bench/big-GGUF"
MAX_CONTEXT = 1024


def model_files(first: Path) -> list[Path]:
    """The model's files: ``first`` alone, or a split model's parts found beside it."""
    with open_model(str(first)) as files:
        return [Path(p) for p in files.paths]


async def milestones(handle: Any) -> dict[str, float]:
    """Seconds from the run's start: planning done, the last node started (its share
    fetched first), the last WeightsReady, the last StageReady."""
    events = (await handle.fetch_history()).events
    t0 = events[0].event_time.ToDatetime()
    out: dict[str, float] = {}
    kinds = {names.ACT_PREPARE_PLAN: "planned", names.ACT_START_NODE: "nodes started"}
    for e in events:
        at = (e.event_time.ToDatetime() - t0).total_seconds()
        if e.HasField("activity_task_completed_event_attributes"):
            scheduled = e.activity_task_completed_event_attributes.scheduled_event_id
            sched = next(x for x in events if x.event_id == scheduled)
            name = sched.activity_task_scheduled_event_attributes.activity_type.name
            if name in kinds:
                out[kinds[name]] = round(at, 2)
            if name == names.ACT_PREPARE_PLAN:  # the activity alone: headers, plan
                took = e.event_time.ToDatetime() - sched.event_time.ToDatetime()
                out["planning activity"] = round(took.total_seconds(), 2)
        signal = e.workflow_execution_signaled_event_attributes.signal_name
        if signal == names.SIGNAL_WEIGHTS_READY:
            out["weights loaded"] = round(at, 2)
        elif signal == names.SIGNAL_STAGE_READY:
            out["stages ready"] = round(at, 2)
    return out


def container_memory(dclient: Any, run_id: int) -> dict[int, dict[str, float | None]]:
    """Each node container of run ``run_id``: its memory now and its peak (MB), by node."""
    out: dict[int, dict[str, float | None]] = {}
    for c in dclient.containers.list(filters={"label": [f"mvp.run-id={run_id}"]}):
        stats = c.stats(stream=False)["memory_stats"]
        inner = stats.get("stats", {})
        used = stats.get("usage", 0) - inner.get(
            "inactive_file", inner.get("total_inactive_file", 0)
        )
        peak = stats.get("max_usage")
        if peak is None:  # cgroup v2: the container's own memory.peak, where there is one
            try:
                peak = int(c.exec_run("cat /sys/fs/cgroup/memory.peak").output.strip())
            except (ValueError, AttributeError):
                peak = None
        out[int(c.labels["mvp.node-id"])] = {
            "mem_mb": round(used / 1e6, 1),
            "peak_mb": None if peak is None else round(peak / 1e6, 1),
            "limit_mb": round(c.attrs["HostConfig"]["Memory"] / 1e6, 1),
        }
    return out


def llama_bench(binary: Path, model: Path, tokens: int, threads: int) -> float:
    """llama-bench's decode tok/s on ``model`` (mean of its repetitions)."""
    out = subprocess.run(
        [
            str(binary),
            "-m",
            str(model),
            "-p",
            "0",
            "-n",
            str(tokens),
            "-t",
            str(threads),
            "-r",
            "2",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return round(float(json.loads(out)[0]["avg_ts"]), 2)


async def one_config(
    stages: int,
    hub: HubStandin,
    work: Path,
    tokens: int,
    model_bytes: int,
    first: str,
    docker_host: str | None = None,
    cpus: float | None = None,
) -> dict[str, Any]:
    d = work / f"stages-{stages}"
    d.mkdir()
    server = start_dev_server(str(d / "t.db"), ip="0.0.0.0" if docker_host else "127.0.0.1")
    env = {
        **os.environ,
        **local_server_env(server.address),
        "MVP_STATE_DIR": str(d / "state"),
        "MVP_MODELS_DIR": str(d / "models"),
        "HF_ENDPOINT": hub.url,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        names.REAPER_INTERVAL_ENV: "0",
        **({"DOCKER_HOST": docker_host} if docker_host else {}),
    }
    env.pop("HF_TOKEN", None)
    log = open(d / "orchestrator.log", "wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "workers.orchestrator"], env=env, stdout=log, stderr=log
    )
    sent0 = hub.bytes_sent()
    try:
        deadline = time.monotonic() + 120
        while b"worker ready" not in (d / "orchestrator.log").read_bytes():
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError(f"the orchestrator worker did not start: see {d}")
            await asyncio.sleep(0.2)
        client = await connect(server.address)
        fields: dict[str, Any] = {
            "model": {"hf": {"repo": HUB_REPO, "file": first}},
            "pipeline_stages": stages,
            "max_context": MAX_CONTEXT,
        }
        if docker_host:
            fields["provider"] = "docker"
            fields["docker"] = {"memory_per_stage": True, "cpus": cpus}
        request = RunRequest.model_validate(fields)
        run_id = 900 + stages
        t0 = time.perf_counter()
        handle = await client.start_workflow(
            names.RUN_WORKFLOW,
            request,
            id=names.run_workflow_id(run_id),
            task_queue=names.ORCHESTRATOR_TASK_QUEUE,
        )
        while True:
            state = await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)
            if state.phase == RunPhase.PROMPT_READY:
                break
            if state.stopping:
                raise RuntimeError(f"{stages} stage(s): stopped: {state.first_fault}")
            await asyncio.sleep(0.1)
        ready_s = time.perf_counter() - t0
        plan = state.plan
        assert plan is not None
        containers: dict[int, dict[str, float | None]] = {}
        if docker_host:
            import docker

            dclient = docker.DockerClient(base_url=docker_host, timeout=60)
            containers = container_memory(dclient, run_id)
            dclient.close()
        nodes = []
        for node in sorted(state.nodes, key=lambda n: n.stage_index):
            h = node.handle
            assert h is not None
            stage = plan.stages[node.stage_index]
            rss = psutil.Process(h.pid).memory_info().rss if h.pid else None
            nodes.append(
                {
                    "stage": node.stage_index,
                    "layers": f"{stage.layers.start}-{stage.layers.end - 1}",
                    "share_mb": round((h.share_bytes or 0) / 1e6, 1),
                    "fetched_mb": round((h.share_fetched or 0) / 1e6, 1),
                    "rss_mb": None if rss is None else round(rss / 1e6, 1),
                    "need_mb": round((stage.memory_need or 0) / 1e6, 1),
                    **containers.get(node.node_id, {}),
                }
            )
        reply = await RunHandle(client, run_id).submit(
            SubmitPrompt(request_id=1, prompt_text="Once upon a time", max_tokens=tokens)
        )
        assert isinstance(reply, Done), reply
        decode = reply.tokens_generated / (reply.elapsed_ms / 1000)
        phases = await milestones(handle)
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
        await handle.result()
        return {
            "stages": stages,
            "prompt_ready_s": round(ready_s, 1),
            "phases_s": phases,
            "nodes": nodes,
            "hub_mb": round((hub.bytes_sent() - sent0) / 1e6, 1),
            "model_mb": round(model_bytes / 1e6, 1),
            "decode_tok_s": round(decode, 2),
            "tokens": reply.tokens_generated,
        }
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        log.close()
        server.stop()
        shutil.rmtree(d / "models", ignore_errors=True)


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    files = model_files(args.model)
    size = sum(p.stat().st_size for p in files)
    print(f"{args.model.name}: {size / 1e9:.2f} GB in {len(files)} file(s); {cpu_model()}")
    work = Path(tempfile.mkdtemp(prefix="bench-big-"))
    out = []
    daemon = None
    if args.provider == "docker":
        from tests.helpers.dockerd import start_dockerd

        daemon = start_dockerd(Path(tempfile.mkdtemp(prefix="bd", dir="/tmp")))
    try:
        with HubStandin() as hub:
            for p in files:
                hub.add_file(HUB_REPO, p.name, p)
            for stages in args.stages:
                row = await one_config(
                    stages,
                    hub,
                    work,
                    args.tokens,
                    size,
                    files[0].name,
                    daemon.host if daemon else None,
                    args.cpus,
                )
                row["provider"] = args.provider
                out.append(row)
                print(json.dumps(row), flush=True)
        if args.llama_bench:
            for threads in sorted(set(args.llama_threads)):
                ref = {"llama_bench_threads": threads}
                ref["llama_bench_decode_tok_s"] = llama_bench(
                    args.llama_bench, files[0], args.tokens, threads
                )
                out.append(ref)
                print(json.dumps(ref), flush=True)
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", type=Path)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--provider", choices=["process", "docker"], default="process")
    ap.add_argument("--cpus", type=float, help="docker: CPUs per node container")
    ap.add_argument("--llama-bench", type=Path, help="llama-bench, run on the same file")
    ap.add_argument(
        "--llama-threads", type=int, nargs="+", default=[1, 2], help="its thread counts"
    )
    args = ap.parse_args()
    rows = asyncio.run(bench(args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
