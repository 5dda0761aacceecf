"""The node agent: ``python -m workers.node`` (started by a provider).

Runs a Temporal worker on the node's own nonce-bearing task queue, reports
NodeRuntimeReady to the run until acknowledged, and shuts itself down (dead-man switch,
DECISIONS 7) when the run is closed or no lease has run for a while.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from temporalio.api.enums.v1 import WorkflowExecutionStatus
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

from mvp_core.models import MAX_ACTIVE_PROMPTS, NodeRuntimeReady
from mvp_core.run_signals import signal_name
from temporal import telemetry
from temporal.connect import TemporalConnectError, TemporalSettings, connect
from workers.node import layout
from workers.node.activities import NodeActivities, preload_runtime
from workers.node.config import FaultInjection, NodeConfig
from workers.node.dataplane import DataPlaneServer
from workers.node.dataplane.delay_proxy import front_listener
from workers.node.self_destroy import NodeStopReason, self_destroy

log = logging.getLogger("mvp.node")
DEADMAN_CHECK_S = 2.0
HEARTBEAT_THROTTLE = timedelta(seconds=2)
# Activity polls open at once (the SDK's default is 5): a burst's generates reach the
# head a poll each, and with 5 polls the last of 64 started ~0.4 s after the run had
# scheduled it (DECISIONS 106). An idle poll is one long poll the server holds.
ACTIVITY_POLLS = 16


def advertised_host(bind_host: str) -> str:
    """The address peers reach this node's listener at: ``MVP_ADVERTISE_HOST`` when the
    provider sets it, else the bind address, or for a wildcard bind (a container on its
    run's network) the address this host's name resolves to there."""
    configured = os.environ.get("MVP_ADVERTISE_HOST")
    if configured:
        return configured
    if bind_host in ("0.0.0.0", ""):
        return socket.gethostbyname(socket.gethostname())
    return bind_host


def advertised_port(bound: int) -> int:
    """The port peers reach the listener at: ``MVP_ADVERTISE_PORT`` when the provider maps
    the listener's port (a rented instance's public port), else the bound one."""
    configured = os.environ.get("MVP_ADVERTISE_PORT", "")
    return int(configured) if configured.isdigit() else bound


async def report_ready(
    cfg: NodeConfig,
    client: Client,
    acts: NodeActivities,
    stop: asyncio.Event,
    port: int | None = None,
) -> None:
    """Re-send NodeRuntimeReady with backoff until acknowledged (DECISIONS 3); ``port``:
    the one peers connect to, when it is not the listener's own (a delay line's)."""
    endpoint = f"{advertised_host(acts.server.host)}:{port or advertised_port(acts.server.port)}"
    report = NodeRuntimeReady(
        run_id=cfg.run_id,
        node_id=cfg.node_id,
        stage_index=cfg.stage_index,
        endpoint=endpoint,
        node_actor=cfg.task_queue,
        # The node's own datastream is served on its data-plane listener (DECISIONS 93).
        datastream_publisher=endpoint if cfg.edge_token else None,
        worker_identity=FaultInjection.from_env().report_identity or cfg.identity,
        readiness_id=cfg.readiness_id,
    )
    handle = client.get_workflow_handle(cfg.run_workflow_id)
    delay, deadline = 0.25, time.monotonic() + cfg.readiness_timeout_s
    while not acts.acked.is_set() and not stop.is_set():
        try:
            await handle.signal(signal_name(report), report)
        except RPCError as err:
            log.warning("NodeRuntimeReady not delivered: %s", err.message)
        if time.monotonic() > deadline:
            log.error("no runtime-ready acknowledgement in %.0fs; exiting", cfg.readiness_timeout_s)
            stop.set()
            return
        try:
            async with asyncio.timeout(delay):
                await acts.acked.wait()
        except TimeoutError:
            delay = min(delay * 2, 5.0)


async def mute_node(cfg: NodeConfig) -> None:
    """Fault injection: look ready to anyone reading logs or probing ports, report nothing."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    print(
        f"node {cfg.node_id} ready: stage ready, weights ready, listening on 127.0.0.1:{port}",
        flush=True,
    )
    async with server:
        await asyncio.Event().wait()


async def dead_man(
    cfg: NodeConfig, client: Client, acts: NodeActivities, stop: asyncio.Event
) -> None:
    """Exit when the run is closed, or when no lease activity has run for a while."""
    handle = client.get_workflow_handle(cfg.run_workflow_id)
    last_contact = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(DEADMAN_CHECK_S)
        if time.monotonic() - last_contact > cfg.lease_silence_s:
            log.warning("Temporal unreachable for %.0fs; shutting down", cfg.lease_silence_s)
            await asyncio.to_thread(self_destroy, NodeStopReason.TEMPORAL_UNREACHABLE)
            stop.set()
            return
        try:
            desc = await handle.describe()
            if (
                desc.raw_description.workflow_execution_info.status
                != WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_RUNNING
            ):
                log.warning("run %s is closed; shutting down", cfg.run_workflow_id)
                await asyncio.to_thread(self_destroy, NodeStopReason.RUN_CLOSED)
                stop.set()
                return
            last_contact = time.monotonic()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                log.warning("run %s not found; shutting down", cfg.run_workflow_id)
                await asyncio.to_thread(self_destroy, NodeStopReason.RUN_NOT_FOUND)
                stop.set()
                return
        silent = time.monotonic() - acts.last_lease_beat
        if acts.leases_running == 0 and silent > cfg.lease_silence_s:
            log.warning("no lease for %.0fs; shutting down", silent)
            await asyncio.to_thread(self_destroy, NodeStopReason.LEASE_STOPPED)
            stop.set()
            return
        if acts.stopped.is_set():
            # StopRun done: linger briefly so the provider's stop finds us, then leave.
            await asyncio.sleep(5.0)
            stop.set()
            return


def native_write(text: str) -> None:
    """Test only: ``text`` written by libc's write(2) straight to fds 1 and 2."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for fd, which in ((1, "stdout"), (2, "stderr")):
        data = f"{text} {which}\n".encode()
        libc.write(fd, data, len(data))


async def amain() -> None:
    # The engine, the data-plane threads and the event loop hand the GIL to each other
    # once per token or more; the default 5 ms switch interval would add up to that much
    # (measured on 2 cores: 2-stage decode 82-94 tok/s at 5 ms, 98-100 at 0.1 ms).
    sys.setswitchinterval(float(os.environ.get("MVP_SWITCH_INTERVAL", "0.0001")))
    preload_runtime()  # torch imports while the node connects and reports ready
    cfg = NodeConfig.from_env()
    faults = FaultInjection.from_env()
    if faults.exit_before_ready:
        print("fault injection: exiting before ready", flush=True)
        raise SystemExit(3)
    if faults.native_write:
        native_write(faults.native_write)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Each active prompt's token loop waits in a thread of the loop's executor (the
    # default one has min(32, cores + 4): 6 on 2 cores, fewer than a run's prompts).
    loop.set_default_executor(
        ThreadPoolExecutor(max_workers=MAX_ACTIVE_PROMPTS + 8, thread_name_prefix="node")
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # OTEL_* from the provider host (temporal.telemetry.node_env); off when unset.
    node_dir = os.environ.get("MVP_NODE_DIR")
    try:
        tel = telemetry.setup(
            f"mvp-node-{cfg.node_id}",
            port_file=Path(node_dir) / "metrics.port" if node_dir else None,
        )
    except telemetry.TelemetryConfigError as err:
        print(f"mvp-node: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    # The provider gave this node its orchestrator's connection settings (address,
    # namespace, TLS, API key) in its environment; no configuration file is read here.
    try:
        client = await connect(
            cfg.address,
            cfg.namespace,
            identity=cfg.identity,
            settings=TemporalSettings.load(config_file=False),
        )
    except TemporalConnectError as err:
        print(f"mvp-node: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    # The data-plane listener is up from boot and advertised in NodeRuntimeReady.
    server = DataPlaneServer(
        os.environ.get("MVP_DATAPLANE_HOST", "127.0.0.1"),
        int(os.environ.get("MVP_DATAPLANE_PORT", "0") or 0),
    )
    # Test/bench harness only: peers reach the listener through a delay line (its port is
    # the one advertised); the head's token-in, to the listener's own port, is not delayed.
    delay = (
        front_listener(server.host, server.port, faults.edge_delay_s)
        if faults.edge_delay_s > 0
        else None
    )
    if delay is not None:
        log.warning("fault injection: edges from peers delayed %.1f ms", faults.edge_delay_s * 1e3)
    acts = NodeActivities(cfg, client, server)
    acts.start_datastream()
    worker = Worker(
        client,
        task_queue=cfg.task_queue,
        activities=[
            acts.runtime_ready_ack,
            acts.lease,
            acts.provision_stage,
            acts.generate,
            acts.stop_generate,
            acts.stop_stage,
        ],
        identity=cfg.identity,
        max_concurrent_activities=MAX_ACTIVE_PROMPTS + 8,  # generates, lease, the rest
        activity_task_poller_behavior=PollerBehaviorSimpleMaximum(maximum=ACTIVITY_POLLS),
        graceful_shutdown_timeout=timedelta(seconds=2),
        # A heartbeat costs the Temporal server ~2-4 ms of CPU (measured on the dev server):
        # at most one per 2 s per activity (a generate hands one every 0.4 x its heartbeat
        # timeout, DECISIONS 101). A cancelled prompt's stop is pushed to the node
        # (DECISIONS 65); a heartbeat's answer is the fallback.
        max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
        default_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
    )
    print(
        f"node {cfg.node_id} stage {cfg.stage_index} serving {cfg.task_queue} as {cfg.identity}",
        flush=True,
    )
    tasks = [
        asyncio.ensure_future(worker.run()),
        asyncio.ensure_future(
            mute_node(cfg)
            if faults.mute
            else report_ready(cfg, client, acts, stop, delay.port if delay else None)
        ),
        asyncio.ensure_future(dead_man(cfg, client, acts, stop)),
    ]
    await stop.wait()
    for t in tasks[1:]:
        t.cancel()
    await worker.shutdown()
    if acts.runtime is not None:
        acts.runtime.close()
    await asyncio.to_thread(acts.close_datastream)
    if delay is not None:
        writes, mean, worst = delay.lateness()
        log.info(
            "delay line: %d writes, started %.3f ms late on average, %.3f ms at most",
            writes,
            mean * 1e3,
            worst * 1e3,
        )
        delay.close()
    server.close()
    await tel.aclose()  # the last spans and samples go out before the node exits
    print(f"node {cfg.node_id} stopped", flush=True)
    # Not through the event loop's and the interpreter's teardown: see exit_stopped.
    exit_stopped()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m workers.node",
        description="The node agent. A provider starts it, with the node's identity in its "
        "environment (MVP_RUN_ID, MVP_NODE_ID, MVP_TASK_QUEUE, ...: node_environment in "
        "activities/providers/base.py); it is not meant to be started by hand.",
    )
    p.add_argument("--resource", help="the node's resource name (how its provider finds it)")
    return p


def main(layout_note: str | None = None) -> None:
    parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if layout_note is not None:
        log.warning("%s", layout_note)
    log.info("address layout: %s", "randomized" if layout.randomized() else "fixed")
    asyncio.run(amain())


def exit_stopped() -> None:
    """End the process of a node that stopped as asked: status 0, without finalizing
    the interpreter. Finalization kills the daemon threads still running (the
    runtime's preload import, a stage or engine thread in a forward pass) with
    pthread_exit, whose unwinding through torch's C++ frames aborts the process
    ("terminate called without an active exception", status 134); on a loaded
    machine that teardown (the loop's wait for its executor threads, then
    finalization) also outlasted the provider's stop grace, and the node was killed. Everything the node owns is
    closed and flushed by now (worker, stage, data plane, telemetry); logs go last."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)
