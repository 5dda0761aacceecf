"""The gateway's side of one HTTP connection: a client that goes away, and a stream of
server-sent events that stops the moment it does (``workers.web.sse``, shared with the
host's dashboard; used by the completions, re-attach and dashboard routes alike)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from workers.web.sse import EventStream, cancel_all, until_disconnect

__all__ = ["ClientGone", "EventStream", "unless_disconnected", "until_disconnect"]
T = TypeVar("T")


class ClientGone(Exception):
    pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled at once if the client goes away first (ClientGone)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await cancel_all(task, watch)
        raise
    if not task.done():
        await cancel_all(task, watch)
        raise ClientGone()
    await cancel_all(watch)
    return task.result()
