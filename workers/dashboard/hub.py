"""The dashboard's page and event stream over one poller (``Hub``): ``GET /dashboard`` and
``GET /dashboard/events`` (server-sent events, one JSON ``Observation`` per change), the
same in the gateway and in the process host.

One poller serves every open page: it runs while a page is connected and a page is sent
a frame only when something changed. Streams are bounded (``MAX_STREAMS`` at once, each
ending after ``STREAM_LIFETIME_S``; the browser's EventSource reconnects on its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from workers.dashboard.observer import INTERVAL_S, Observer
from workers.dashboard.view import Observation
from workers.web.sse import EventStream

log = logging.getLogger("mvp.dashboard")

MAX_STREAMS = 16  # open event streams at once; more are a 503
STREAM_LIFETIME_S = 300.0  # then the stream ends and the browser reconnects
KEEPALIVE_S = 15.0  # a comment line when nothing changed for this long
RETRY_MS = 1000  # EventSource's reconnection delay


class Refused(Exception):
    """A stream the dashboard will not open now: a 503 with OpenAI's error body (as the
    gateway's other errors), ``Retry-After`` when it says when."""

    def __init__(self, message: str, code: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = 503
        self.message = message
        self.code = code
        self.retry_after_s = retry_after_s

    def response(self) -> Response:
        body = {
            "error": {
                "message": self.message,
                "type": "server_error",
                "param": None,
                "code": self.code,
            }
        }
        headers = {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}
        return JSONResponse(body, status_code=self.status, headers=headers)


class Hub:
    """One poller for every open page: it runs while a stream is open and publishes a
    new frame only when the observation changed."""

    def __init__(
        self,
        observer: Observer,
        *,
        interval_s: float = INTERVAL_S,
        max_streams: int = MAX_STREAMS,
    ) -> None:
        self.observer = observer
        self.interval_s = interval_s
        self.max_streams = max_streams
        self.streams = 0
        self.version = 0
        self.latest: str | None = None  # the last frame's JSON
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.closed = False  # the server is stopping: streams end, new ones are refused
        self.final: str | None = None  # the frame a closing stream still sends (its last)

    def close(self) -> None:
        """End every open stream now (the server then stops without waiting for them)."""
        self.closed = True
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def finish(self) -> None:
        """The last word before ``close``: one more observation (the run's end, read now)
        published, which every open stream sends before it ends."""
        if self.streams == 0 or self.closed:
            self.close()
            return
        try:
            self.publish(await self.observer.observe(final=True))
        except Exception as err:  # the end could not be read: what was shown stays
            log.warning("dashboard's last observation failed: %s: %s", type(err).__name__, err)
        self.final = self.latest
        self.closed = True
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def subscribe(self) -> Subscription:
        if self.closed:
            raise Refused("the server is stopping", code="dashboard_closed")
        if self.streams >= self.max_streams:
            raise Refused(
                f"the dashboard has {self.max_streams} open streams already; retry later",
                code="dashboard_busy",
                retry_after_s=5,
            )
        self.streams += 1
        if self._task is None:
            self._task = asyncio.ensure_future(self._poll())
        return Subscription(self)

    def _release(self) -> None:
        self.streams -= 1
        if self.streams == 0 and self._task is not None:
            self._task.cancel()
            self._task = None
            self.latest = None  # the next page waits for a fresh frame
            self.observer.idle()

    @property
    def polling(self) -> bool:
        return self._task is not None

    def publish(self, observation: Observation) -> bool:
        frame = observation.model_dump_json()
        if frame == self.latest:
            return False
        self.latest = frame
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return True

    async def wait(self, seen: int, within_s: float) -> bool:
        """True once there is a frame newer than ``seen``; False after ``within_s``."""
        if self.version > seen and self.latest is not None:
            return True
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await changed.wait()
        return self.version > seen and self.latest is not None

    async def _poll(self) -> None:
        failure: str | None = None  # logged once, not every round, until it changes
        while True:
            try:
                self.publish(await self.observer.observe())
                failure = None
            except asyncio.CancelledError:
                raise
            except Exception as err:
                text = f"{type(err).__name__}: {err}"
                if text != failure:
                    log.warning("dashboard observation failed: %s", text)
                failure = text
            await self.observer.pace(self.interval_s)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.observer.aclose()


class Subscription:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.hub._release()

    async def aclose(self) -> None:
        self.close()


def sse_frame(data: str, event_id: int | None = None) -> bytes:
    """One server-sent event; a line break in ``data`` starts another data line."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    body = "".join(f"data: {line}\n" for line in data.split("\n"))
    return (head + body + "\n").encode()


async def frames(
    hub: Hub,
    sub: Subscription,
    *,
    lifetime_s: float = STREAM_LIFETIME_S,
    keepalive_s: float = KEEPALIVE_S,
) -> AsyncGenerator[bytes, None]:
    """A stream's events: the reconnection delay, the latest frame, each newer one, a
    comment when nothing changed for ``keepalive_s``; it ends after ``lifetime_s``."""
    try:
        yield f"retry: {RETRY_MS}\n\n".encode()
        seen = 0
        deadline = time.monotonic() + lifetime_s
        while (left := deadline - time.monotonic()) > 0 and not hub.closed:
            if await hub.wait(seen, min(keepalive_s, left)):
                if hub.closed and hub.latest != hub.final:
                    break  # closed before it had the last word (the host's run's end)
                seen = hub.version
                assert hub.latest is not None
                yield sse_frame(hub.latest, seen)
            elif deadline - time.monotonic() > 0:
                yield b": keepalive\n\n"
    finally:
        sub.close()


def page() -> str:
    return resources.files("workers.dashboard").joinpath("page.html").read_text("utf-8")


class Dashboard:
    """The page and its event stream over one hub; GET only, reads only."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.html = page()

    def routes(self) -> list[Route]:
        return [
            Route("/dashboard", self.page, methods=["GET"]),
            Route("/dashboard/events", self.events, methods=["GET"]),
        ]

    async def page(self, request: Request) -> Response:
        return HTMLResponse(self.html, headers={"Cache-Control": "no-cache"})

    async def events(self, request: Request) -> Response:
        try:
            sub = self.hub.subscribe()
        except Refused as err:
            return err.response()
        return EventStream(frames(self.hub, sub), on_close=sub.aclose)
