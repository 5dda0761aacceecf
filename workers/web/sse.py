"""Server-sent events over one HTTP connection that stop the moment its client goes away
(the gateway's completions, re-attach and dashboard routes, the host's dashboard)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("mvp.web")


async def until_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request body was read before)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_all(*tasks: asyncio.Future[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class EventStream(Response):
    """Server-sent events from an async generator; a client that goes away cancels the
    generator at once (its ``finally`` ends the prompt), without waiting for the next
    write to fail."""

    media_type = "text/event-stream"

    def __init__(
        self, chunks: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._chunks = chunks
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                exc = pump.exception()
                if not isinstance(exc, OSError):
                    log.warning("event stream failed: %s: %s", type(exc).__name__, exc)
        finally:
            await cancel_all(pump, watch)
            await self._chunks.aclose()
            await self._on_close()  # a generator closed before it started has no finally

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for chunk in self._chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
