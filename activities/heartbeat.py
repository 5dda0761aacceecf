"""Blocking work in a thread, heartbeating meanwhile: an activity whose worker is lost
then costs its heartbeat timeout (seconds), not its whole start-to-close timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

from temporalio import activity

T = TypeVar("T")
HEARTBEAT_EVERY_S = 1.0


async def heartbeat_for(seconds: float, details: str) -> None:
    """Wait ``seconds`` in the activity, heartbeating (a test harness's slow step)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        activity.heartbeat(details)
        await asyncio.sleep(min(HEARTBEAT_EVERY_S, max(deadline - loop.time(), 0.0)))


async def in_thread(
    fn: Callable[..., T], *args: object, details: Callable[[], object] | None = None
) -> T:
    """``fn(*args)`` in a worker thread; the activity heartbeats until it returns, with
    ``details()`` where given (what the work has done so far)."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    while True:
        if details is None:
            activity.heartbeat()
        else:
            activity.heartbeat(details())
        done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_EVERY_S)
        if done:
            return task.result()


def activity_deadline() -> float | None:
    """When (``time.monotonic()``) the activity this code runs in reaches its
    start-to-close timeout (else its schedule-to-close one); None outside an activity,
    or when its recorded start time cannot be right (in the future, or longer ago than
    its timeout: an activity that late would already have timed out)."""
    if not activity.in_activity():
        return None
    info = activity.info()
    timeout = info.start_to_close_timeout or info.schedule_to_close_timeout
    if not timeout:
        return None
    elapsed = (datetime.now(UTC) - info.started_time).total_seconds()
    if not 0 <= elapsed <= timeout.total_seconds():
        return None
    return time.monotonic() + timeout.total_seconds() - elapsed
