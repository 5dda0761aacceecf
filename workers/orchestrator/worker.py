"""The orchestrator worker: ``python -m workers.orchestrator``.

Hosts RunWorkflow, PromptWorkflow and ReaperWorkflow plus the shared activities on
``mvp-orchestrator``, and this host's provider activities on ``mvp-provider-<host>``.
Run as many as you like; a killed one loses nothing, because a run's state is its
workflow history. On start it makes this host's reaper schedule (idempotently).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from activities import datastream_bus
from activities.datastream import run_datastream
from activities.membership import check_route
from activities.planning import PlanningActivities, provider_host, provider_queue
from activities.provisioning import ProviderActivities
from activities.reaper import ReaperActivities, run_liveness
from mvp_core import names
from temporal import telemetry
from temporal.connect import (
    TemporalConnectError,
    TemporalSettings,
    check_namespace,
    connect,
    default_data_converter,
)
from temporal.search_attributes import check_search_attributes
from workers.orchestrator.reaper_schedule import ensure_reaper_schedule, reaper_interval_s
from workflows.prompt import PromptWorkflow
from workflows.reaper import ReaperWorkflow
from workflows.run import RunWorkflow

log = logging.getLogger("mvp.orchestrator")
SHUTDOWN_DEADLINE_S = 8.0
PROVIDER_HEARTBEAT_THROTTLE = timedelta(seconds=0.5)


async def run_worker(stop: asyncio.Event) -> None:
    # Where and how to connect: envconfig (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE,
    # TEMPORAL_API_KEY, TEMPORAL_TLS_*, a profile: docs/temporal-connection.md).
    settings = TemporalSettings.load()
    # A forged or wrong-key payload must not fail the run's workflow tasks.
    client = await connect(data_converter=default_data_converter(lenient=True), settings=settings)
    await check_namespace(client, settings)
    # A namespace without the workflows' search attributes would fail their every task
    # (and hang every prompt): refuse to start, saying how to create them.
    await check_search_attributes(client, settings.address)
    providers = ProviderActivities()
    datastream_bus.install_provider_log_handler()  # provider progress -> run datastreams
    reaper = ReaperActivities(providers)
    planning = PlanningActivities(providers)
    host_queue = names.provider_task_queue(provider_host())
    # A worker lost mid-task costs its sticky queue's schedule-to-start (default 10 s)
    # before another worker takes the run: keep it short. MVP_MAX_CACHED_WORKFLOWS=0
    # replays every workflow task from history (the reliability suite uses it).
    shared = Worker(
        client,
        task_queue=names.ORCHESTRATOR_TASK_QUEUE,
        workflows=[RunWorkflow, PromptWorkflow, ReaperWorkflow],
        activities=[provider_queue, check_route, run_liveness],
        max_concurrent_activities=64,
        graceful_shutdown_timeout=timedelta(seconds=3),
        max_cached_workflows=int(os.environ.get("MVP_MAX_CACHED_WORKFLOWS", "1000")),
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=names.STICKY_SCHEDULE_TO_START_S),
    )
    local = Worker(
        client,
        task_queue=host_queue,
        activities=[
            planning.prepare_plan,
            providers.start_node,
            providers.stop_node,
            providers.complete_bootstrap,
            providers.watch_nodes,
            run_datastream,
            reaper.list_resources,
            reaper.destroy_resource,
        ],
        max_concurrent_activities=64,
        # Heartbeats carry cancellation back: the run's close waits for its provider
        # watch and its datastream to end (DECISIONS 54, 58), which the default throttle (0.8 x its 10 s
        # heartbeat timeout) would delay by up to 8 s.
        max_heartbeat_throttle_interval=PROVIDER_HEARTBEAT_THROTTLE,
        default_heartbeat_throttle_interval=PROVIDER_HEARTBEAT_THROTTLE,
    )
    log.info(
        "orchestrator worker on %s (queues %s, %s)",
        settings.describe(),
        names.ORCHESTRATOR_TASK_QUEUE,
        host_queue,
    )
    await _ensure_reaper(client)
    running = [asyncio.ensure_future(w.run()) for w in (shared, local)]
    print(
        f"mvp-orchestrator worker ready: {names.ORCHESTRATOR_TASK_QUEUE} + {host_queue}",
        flush=True,
    )
    _say_ready()
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stopping, *running], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    # Bounded: with Temporal unreachable, a worker's shutdown would wait on its pollers.
    try:
        async with asyncio.timeout(SHUTDOWN_DEADLINE_S):
            await asyncio.gather(
                shared.shutdown(), local.shutdown(), *running, return_exceptions=True
            )
    except TimeoutError:
        log.warning("workers did not stop in %.0f s (Temporal unreachable?)", SHUTDOWN_DEADLINE_S)
    for task in running:
        err = task.exception() if task.done() and not task.cancelled() else None
        if err is not None:
            raise err  # a worker that failed by itself: exit non-zero, saying why


async def _ensure_reaper(client: Client) -> None:
    """This host's reaper schedule; a failure is logged, the worker still serves runs."""
    interval_s = reaper_interval_s()  # a bad MVP_REAPER_INTERVAL_S fails the start
    try:
        log.info("%s", await ensure_reaper_schedule(client, provider_host(), interval_s))
    except Exception:
        log.exception("could not make the reaper schedule of %s", provider_host())


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        tel = telemetry.setup("mvp-orchestrator")
    except telemetry.TelemetryConfigError as err:
        print(f"mvp-orchestrator worker: {err}", file=sys.stderr, flush=True)
        os._exit(1)
    try:
        loop.run_until_complete(run_worker(stop))
        loop.run_until_complete(tel.aclose())  # the last spans and metrics go out
    except TemporalConnectError as err:
        # One line naming the cause (never a credential), no traceback: a wrong API key,
        # an untrusted certificate, a server that is not there.
        print(f"mvp-orchestrator worker: {err}", file=sys.stderr, flush=True)
        os._exit(1)
    # Threads of activities abandoned at the deadline (a provider call that hangs) must not
    # keep the process alive past it.
    os._exit(0)


if __name__ == "__main__":
    main()


def _say_ready() -> None:
    """Tell the host that started this worker that it polls (the pipe it handed over as
    ``MVP_READY_FD``), then close it: the host waits on that line, or on its end."""
    fd = os.environ.pop(names.WORKER_READY_FD_ENV, "")
    if not fd.isdigit():
        return
    with contextlib.suppress(OSError):
        os.write(int(fd), b"ready\n")
    with contextlib.suppress(OSError):
        os.close(int(fd))
