"""Blocking work in a thread, heartbeating meanwhile: an activity whose worker is lost
then costs its heartbeat timeout (seconds), not its whole start-to-close timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from temporalio import activity

T = TypeVar("T")
HEARTBEAT_EVERY_S = 1.0


async def in_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a worker thread; the activity heartbeats until it returns."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    while True:
        activity.heartbeat()
        done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_EVERY_S)
        if done:
            return task.result()
