"""The orchestrator worker: ``python -m workers.orchestrator``.

Hosts RunWorkflow and PromptWorkflow plus the shared activities on ``mvp-orchestrator``,
and this host's provider activities on ``mvp-provider-<host>``. Run as many as you
like; a killed one loses nothing, because a run's state is its workflow history.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from datetime import timedelta

from temporalio.worker import Worker

from activities.membership import check_route
from activities.planning import prepare_plan, provider_host, provider_queue
from activities.provisioning import ProviderActivities
from mvp_core import names
from workers.connect import connect, default_data_converter, temporal_address
from workflows.prompt import PromptWorkflow
from workflows.run import RunWorkflow

log = logging.getLogger("mvp.orchestrator")
SHUTDOWN_DEADLINE_S = 8.0


async def run_worker(stop: asyncio.Event) -> None:
    # A forged or wrong-key payload must not fail the run's workflow tasks.
    client = await connect(data_converter=default_data_converter(lenient=True))
    providers = ProviderActivities()
    host_queue = names.provider_task_queue(provider_host())
    # A worker lost mid-task costs its sticky queue's schedule-to-start (default 10 s)
    # before another worker takes the run: keep it short. MVP_MAX_CACHED_WORKFLOWS=0
    # replays every workflow task from history (the reliability suite uses it).
    shared = Worker(
        client,
        task_queue=names.ORCHESTRATOR_TASK_QUEUE,
        workflows=[RunWorkflow, PromptWorkflow],
        activities=[provider_queue, check_route],
        max_concurrent_activities=64,
        graceful_shutdown_timeout=timedelta(seconds=3),
        max_cached_workflows=int(os.environ.get("MVP_MAX_CACHED_WORKFLOWS", "1000")),
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=names.STICKY_SCHEDULE_TO_START_S),
    )
    local = Worker(
        client,
        task_queue=host_queue,
        activities=[prepare_plan, providers.start_node, providers.stop_node, providers.watch_nodes],
        max_concurrent_activities=64,
    )
    log.info(
        "orchestrator worker on %s (queues %s, %s)",
        temporal_address(),
        names.ORCHESTRATOR_TASK_QUEUE,
        host_queue,
    )
    running = [asyncio.ensure_future(w.run()) for w in (shared, local)]
    print(
        f"mvp-orchestrator worker ready: {names.ORCHESTRATOR_TASK_QUEUE} + {host_queue}",
        flush=True,
    )
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stopping, *running], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    # Bounded: with Temporal unreachable, a worker's shutdown would wait on its pollers.
    try:
        await asyncio.wait_for(
            asyncio.gather(shared.shutdown(), local.shutdown(), *running, return_exceptions=True),
            SHUTDOWN_DEADLINE_S,
        )
    except TimeoutError:
        log.warning("workers did not stop in %.0f s (Temporal unreachable?)", SHUTDOWN_DEADLINE_S)
    for task in running:
        err = task.exception() if task.done() and not task.cancelled() else None
        if err is not None:
            raise err  # a worker that failed by itself: exit non-zero, saying why


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.run_until_complete(run_worker(stop))
    # Threads of activities abandoned at the deadline (a provider call that hangs) must not
    # keep the process alive past it.
    os._exit(0)


if __name__ == "__main__":
    main()
