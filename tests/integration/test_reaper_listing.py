"""The reaper's sweeps in the Web UI's workflow list (issue 38 item 15c): one a minute,
each says what it is (its static summary) and the documented filters find them or leave
them out (docs/reliability.md "The reaper"), on the dev server's own visibility."""

from __future__ import annotations

from temporalio.client import (
    Client,
    ScheduleActionExecutionStartWorkflow,
    ScheduleActionStartWorkflow,
)

from mvp_core import names
from tests.helpers.waits import eventually
from workers.orchestrator.reaper_schedule import (
    HIDE_SWEEPS,
    ensure_reaper_schedule,
    reaper_schedule,
)

HOST = "reaper-listing-host"


async def test_a_sweep_says_what_it_is_and_the_documented_filters_find_or_hide_it(
    client: Client,
) -> None:
    schedule_id = names.reaper_schedule_id(HOST)
    schedule = client.get_schedule_handle(schedule_id)
    wf_id = None
    try:
        # An older worker's schedule: its sweeps had no summary. A worker of today's
        # brings it in line.
        old = reaper_schedule(HOST, 3600)
        assert isinstance(old.action, ScheduleActionStartWorkflow)
        old.action.static_summary = old.action.static_details = None
        await client.create_schedule(schedule_id, old)
        assert "updated" in await ensure_reaper_schedule(client, HOST, 3600)
        assert "exists" in await ensure_reaper_schedule(client, HOST, 3600)
        # No worker sweeps this host: the sweep stays open, listed as it would be.
        await schedule.trigger()

        async def started() -> str | None:
            for a in (await schedule.describe()).info.recent_actions:
                if isinstance(a.action, ScheduleActionExecutionStartWorkflow):
                    return a.action.workflow_id
            return None

        wf_id = await eventually(started, timeout=30, what="the sweep", interval=0.2)
        desc = await client.get_workflow_handle(wf_id).describe()
        assert await desc.static_summary() == f"reaper sweep of host {HOST}"
        assert HIDE_SWEEPS in (await desc.static_details() or "")

        async def listed(query: str) -> list[str]:
            return [
                w.id async for w in client.list_workflows(f"{query} AND WorkflowId = '{wf_id}'")
            ]

        async def found() -> bool:
            return await listed(f"TemporalScheduledById = '{schedule_id}'") == [wf_id]

        await eventually(found, timeout=30, what="the sweep in the list", interval=0.2)
        assert await listed(f"WorkflowType = '{names.REAPER_WORKFLOW}'") == [wf_id]
        assert await listed(HIDE_SWEEPS) == []  # the Web UI's filter leaves it out
        assert await listed("TemporalScheduledById IS NULL") == []
    finally:
        if wf_id is not None:
            await client.get_workflow_handle(wf_id).terminate("test over")
        await schedule.delete()
