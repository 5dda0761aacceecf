"""The reaper's Temporal Schedule of a host, made when an orchestrator worker starts.

One schedule per provider host, ``mvp-reaper-<host>``, starts a ReaperWorkflow every
``MVP_REAPER_INTERVAL_S`` seconds (default 60; 0 = leave the schedule alone, neither
made nor changed). Every worker of the host makes it idempotently: the first one makes
it, the others find it (and bring its interval in line with theirs when it differs).
Overlap SKIP: a sweep that outlasts the interval is never joined by a second one.

Each sweep is a workflow of its own in the namespace's list, one a minute: it carries a
static summary (``reaper sweep of host <host>``) and, as every scheduled workflow does,
the search attribute ``TemporalScheduledById`` (the schedule's id), so the Web UI can
show it or leave it out: ``WorkflowType != "ReaperWorkflow"`` (docs/reliability.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleUpdate,
    ScheduleUpdateInput,
)

from mvp_core import names
from mvp_core.reaper import ReapInput

log = logging.getLogger("mvp.reaper")
# A sweep that hangs (a provider call that never returns) must not hold the SKIP forever.
SWEEP_TIMEOUT = timedelta(minutes=10)
# The Web UI's list query that leaves the sweeps out (docs/reliability.md "The reaper").
HIDE_SWEEPS = f'WorkflowType != "{names.REAPER_WORKFLOW}"'


def sweep_summary(host: str) -> str:
    """The Web UI's one line for a sweep of ``host``."""
    return f"reaper sweep of host {host}"


def reaper_interval_s(environ: Mapping[str, str] | None = None) -> int:
    """``MVP_REAPER_INTERVAL_S`` (whole seconds, >= 0); 0 switches the schedule off."""
    env = os.environ if environ is None else environ
    raw = env.get(names.REAPER_INTERVAL_ENV, "").strip()
    if not raw:
        return names.REAPER_DEFAULT_INTERVAL_S
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"{names.REAPER_INTERVAL_ENV} must be whole seconds, got {raw!r}"
        ) from None
    if value < 0:
        raise ValueError(f"{names.REAPER_INTERVAL_ENV} must be >= 0, got {value}")
    return value


def reaper_schedule(host: str, interval_s: int) -> Schedule:
    """The schedule that sweeps ``host`` every ``interval_s`` seconds."""
    return Schedule(
        action=ScheduleActionStartWorkflow(
            names.REAPER_WORKFLOW,
            ReapInput(host=host),
            id=names.reaper_workflow_id(host),
            task_queue=names.ORCHESTRATOR_TASK_QUEUE,
            execution_timeout=SWEEP_TIMEOUT,
            task_timeout=timedelta(seconds=names.WORKFLOW_TASK_TIMEOUT_S),
            # Ids only: where it sweeps, what starts it, and how to leave it out of a list.
            static_summary=sweep_summary(host),
            static_details=(
                f"provider resources of host {host}, swept every {interval_s} s by the "
                f"schedule {names.reaper_schedule_id(host)}; to leave the sweeps out of "
                f"the workflow list, filter with {HIDE_SWEEPS}"
            ),
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=timedelta(seconds=interval_s))]),
        policy=SchedulePolicy(
            overlap=ScheduleOverlapPolicy.SKIP,
            # After an outage, one sweep, not one per interval missed.
            catchup_window=timedelta(seconds=max(interval_s, 60)),
        ),
    )


def _intervals(schedule: Schedule) -> list[tuple[timedelta, timedelta]]:
    return [(i.every, i.offset or timedelta(0)) for i in schedule.spec.intervals]


async def ensure_reaper_schedule(client: Client, host: str, interval_s: int) -> str:
    """Make or align ``host``'s reaper schedule; what was done, in words."""
    schedule_id = names.reaper_schedule_id(host)
    if interval_s <= 0:
        return f"reaper schedule {schedule_id} left alone ({names.REAPER_INTERVAL_ENV}=0)"
    desired = reaper_schedule(host, interval_s)
    try:
        await client.create_schedule(schedule_id, desired)
        return f"reaper schedule {schedule_id} created: every {interval_s} s"
    except ScheduleAlreadyRunningError:
        pass
    handle = client.get_schedule_handle(schedule_id)
    current = (await handle.describe()).schedule
    if (
        _intervals(current) == _intervals(desired)
        and current.policy.overlap == desired.policy.overlap
        and isinstance(current.action, ScheduleActionStartWorkflow)
        and current.action.workflow == names.REAPER_WORKFLOW
        and current.action.task_queue == names.ORCHESTRATOR_TASK_QUEUE
        # (An older worker's schedule started its sweeps without a summary.)
        and current.action.static_summary is not None
    ):
        return f"reaper schedule {schedule_id} exists: every {interval_s} s"

    def update(inp: ScheduleUpdateInput) -> ScheduleUpdate:
        schedule = inp.description.schedule
        # The operator's pause (schedule.state) is kept; what the worker owns is replaced.
        schedule.action, schedule.spec, schedule.policy = (
            desired.action,
            desired.spec,
            desired.policy,
        )
        return ScheduleUpdate(schedule=schedule)

    await handle.update(update)
    return f"reaper schedule {schedule_id} updated: every {interval_s} s"
