"""The gateway's live dashboard: ``GET /dashboard`` (a page) and ``GET /dashboard/events``
(server-sent events, one JSON ``Observation`` per change).

It observes, never controls: every figure comes from reads of Temporal and of files:

- each run's ``snapshot`` query (phase, plan, stages and their nodes, the prompt queue,
  lifecycle reports) and ``describe`` (open or closed);
- other open runs (``RunWorkflow``, ``ExecutionStatus = 'Running'``) from visibility;
- each finished prompt's workflow history, once: its start, the scheduling of its
  generate activity, its first published text (time to first token) and its result
  (tokens and the head node's generation time, for tokens/s);
- the tail of each node's log, read from the ``log_path`` of the node's provider handle
  when the node's host is this one (redacted as the datastream redacts).

One poller serves every open page: it runs while a page is connected (every
``interval_s``; the other runs every ``OTHERS_EVERY_S``) and a page is sent a frame only
when something changed. Streams are bounded (``MAX_STREAMS`` at once, each ending after
``STREAM_LIFETIME_S``; the browser's EventSource reconnects on its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Collection, Iterable
from importlib import resources
from typing import Any, Protocol

from google.protobuf.timestamp_pb2 import Timestamp
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.service import RPCError, RPCStatusCode

from mvp_core import names
from mvp_core.datastream import Redactor
from mvp_core.models import NodeHandle, PromptHost, PromptOutcome
from mvp_core.run_state import RunState
from temporal.client import QUERY_TIMEOUT, PromptUnavailable, RunHandle
from temporal.client.fetches import share_fetches
from workers.gateway.dashboard_feed import DatastreamFeed
from workers.gateway.dashboard_view import (
    RECENT_PROMPTS,
    LogTail,
    Observation,
    PromptFigures,
    RunStatus,
    RunView,
    clip,
    figures,
    finished_prompts,
    run_view,
    served_figures,
)
from workers.gateway.service import Gateway
from workers.gateway.streaming import EventStream
from workers.gateway.wire import ApiError

log = logging.getLogger("mvp.gateway.dashboard")

INTERVAL_S = 0.5  # how often the served run is read while a page is open
OTHERS_EVERY_S = 3.0  # how often other open runs are listed and read
# While the served run's datastream is followed, its frames say when to read the run
# again; without one for this long, it is read anyway (a change the datastream does not
# carry: the prompt queue between admissions).
FOLLOWED_EVERY_S = 2.0
MAX_OTHER_RUNS = 7
MAX_STREAMS = 16  # open event streams at once; more are a 503
STREAM_LIFETIME_S = 300.0  # then the stream ends and the browser reconnects
KEEPALIVE_S = 15.0  # a comment line when nothing changed for this long
RETRY_MS = 1000  # EventSource's reconnection delay
FIGURES_KEPT = 256  # finished prompts whose figures are cached
FIGURE_TRIES = 3  # a prompt whose history cannot be read after this many tries goes without
LOG_LINES = 12
LOG_LINE_CHARS = 240
LOG_READ_BYTES = 16 * 1024
# The signal that carries a workflow stream's published items (temporalio.contrib
# .workflow_streams): a prompt's first one holds its first text (sent at once).
STREAM_PUBLISH_SIGNAL = "__temporal_workflow_stream_publish"

_STATUS: dict[WorkflowExecutionStatus, RunStatus] = {
    WorkflowExecutionStatus.RUNNING: "running",
    WorkflowExecutionStatus.COMPLETED: "completed",
    WorkflowExecutionStatus.FAILED: "failed",
    WorkflowExecutionStatus.CANCELED: "canceled",
    WorkflowExecutionStatus.TERMINATED: "terminated",
    WorkflowExecutionStatus.CONTINUED_AS_NEW: "continued_as_new",
    WorkflowExecutionStatus.TIMED_OUT: "timed_out",
}


# --------------------------------------------------------------------------- sources


class SourceError(Exception):
    """A read that did not answer; the message says which and why, in a few words."""


class RunSource(Protocol):
    """The reads the dashboard makes (Temporal in the gateway, a script in tests)."""

    async def describe(self, workflow_id: str) -> tuple[RunStatus, str | None]:
        """The run's status and its execution's id (``not_found``: no such run)."""
        ...

    async def snapshot(self, workflow_id: str) -> RunState: ...

    async def running_runs(self, limit: int) -> list[str]:
        """Workflow ids of open runs, newest first."""
        ...

    async def prompt_figures(self, workflow_id: str) -> PromptFigures: ...

    async def fetches(self, workflow_id: str) -> dict[int, tuple[int, int]]:
        """The node shares being fetched now, by node: (bytes held, bytes in all), from
        the start activities' heartbeats (activities/model_share.py)."""
        ...

    async def served_figures(
        self, run_workflow_id: str, request_id: int, key: str
    ) -> PromptFigures:
        """A run-hosted prompt's figures (DECISIONS 66), from what its run kept of it."""
        ...


class TemporalSource:
    """Reads of Temporal only: describe, query, visibility list and history."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def describe(self, workflow_id: str) -> tuple[RunStatus, str | None]:
        try:
            desc = await self.client.get_workflow_handle(workflow_id).describe(
                rpc_timeout=QUERY_TIMEOUT
            )
        except RPCError as err:
            if err.status is RPCStatusCode.NOT_FOUND:
                return "not_found", None
            raise SourceError(f"describe failed: {err.message}") from None
        status = _STATUS.get(desc.status, "running") if desc.status else "running"
        return status, desc.run_id

    async def fetches(self, workflow_id: str) -> dict[int, tuple[int, int]]:
        try:
            return await share_fetches(self.client, workflow_id)
        except RPCError as err:
            raise SourceError(f"describe failed: {err.message}") from None

    async def snapshot(self, workflow_id: str) -> RunState:
        try:
            state: RunState = await self.client.get_workflow_handle(workflow_id).query(
                names.QUERY_SNAPSHOT, result_type=RunState, rpc_timeout=QUERY_TIMEOUT
            )
        except RPCError as err:
            raise SourceError(f"snapshot query failed: {err.message}") from None
        except (WorkflowQueryFailedError, WorkflowQueryRejectedError) as err:
            raise SourceError(f"snapshot query failed: {err}") from None
        return state

    async def running_runs(self, limit: int) -> list[str]:
        query = f"WorkflowType = '{names.RUN_WORKFLOW}' AND ExecutionStatus = 'Running'"
        try:
            return [
                wf.id
                async for wf in self.client.list_workflows(
                    query, limit=limit, rpc_timeout=QUERY_TIMEOUT
                )
            ]
        except RPCError as err:
            raise SourceError(f"visibility list failed: {err.message}") from None

    async def prompt_figures(self, workflow_id: str) -> PromptFigures:
        try:
            history = await self.client.get_workflow_handle(workflow_id).fetch_history(
                rpc_timeout=QUERY_TIMEOUT
            )
        except RPCError as err:
            raise SourceError(f"history of {workflow_id}: {err.message}") from None
        times = history_times(history.events)
        outcome: PromptOutcome | None = None
        if times.result is not None:
            try:
                decoded = await self.client.data_converter.decode(times.result, [PromptOutcome])
                outcome = decoded[0]
            except Exception as err:  # a payload this gateway cannot decode (a codec)
                log.warning("result of %s: %s", workflow_id, type(err).__name__)
        return figures(
            outcome,
            started_ms=times.started_ms,
            scheduled_ms=times.scheduled_ms,
            first_text_ms=times.first_text_ms,
        )

    async def served_figures(
        self, run_workflow_id: str, request_id: int, key: str
    ) -> PromptFigures:
        run_id = names.run_id_from_workflow_id(run_workflow_id)
        if run_id is None:
            raise SourceError(f"prompt {key}: {run_workflow_id} is not a run's workflow id")
        try:
            served = await RunHandle(self.client, run_id, direct_text=False).served(request_id)
        except PromptUnavailable as err:
            raise SourceError(f"prompt {key}: {err}") from None
        if served is None or served.workflow_id != key:
            raise SourceError(f"prompt {key}: no longer kept by its run")
        return served_figures(served)


class HistoryTimes:
    """What a prompt's history tells the dashboard (event times in epoch ms)."""

    def __init__(self) -> None:
        self.started_ms: int | None = None
        self.scheduled_ms: int | None = None
        self.first_text_ms: int | None = None
        self.result: list[Any] | None = None  # the completion's payloads, undecoded


def _ms(stamp: Timestamp) -> int:
    return stamp.seconds * 1000 + stamp.nanos // 1_000_000


def history_times(events: Iterable[HistoryEvent]) -> HistoryTimes:
    """The start, the first activity scheduled, the first stream publish and the result
    of a prompt workflow's history (payloads are not read, only the result kept)."""
    out = HistoryTimes()
    for event in events:
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            out.started_ms = _ms(event.event_time)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED and out.scheduled_ms is None:
            out.scheduled_ms = _ms(event.event_time)
        elif (
            kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
            and out.first_text_ms is None
            and event.workflow_execution_signaled_event_attributes.signal_name
            == STREAM_PUBLISH_SIGNAL
        ):
            out.first_text_ms = _ms(event.event_time)
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
            out.result = list(event.workflow_execution_completed_event_attributes.result.payloads)
    return out


# --------------------------------------------------------------------------- node logs


class LocalLogs:
    """Tails of node logs that lie on this host (the process provider's, a Docker node's
    once it stopped, a Vast.ai node's copy): the last lines, redacted."""

    def __init__(self, hostname: str | None = None, redactor: Redactor | None = None) -> None:
        self.hostname = hostname or socket.gethostname()
        self.redactor = redactor or Redactor.from_env(os.environ)
        self._cache: dict[str, tuple[int, int, LogTail]] = {}

    def tails(self, state: RunState, skip: Collection[int] = ()) -> dict[int, LogTail]:
        """Each node's tail, but for the nodes in ``skip`` (whose lines come from elsewhere:
        the run's datastream)."""
        return {
            n.node_id: self.tail(n.handle)
            for n in state.nodes
            if n.handle is not None and n.node_id not in skip
        }

    def tail(self, handle: NodeHandle) -> LogTail:
        if handle.log_path is None:
            return LogTail(note="its provider keeps no log file")
        if handle.host != self.hostname:
            return LogTail(note=f"on host {handle.host}: not readable from this gateway")
        path = handle.log_path
        try:
            st = os.stat(path)
        except OSError:
            return LogTail(note="no log written yet")
        cached = self._cache.get(path)
        if cached is not None and cached[:2] == (st.st_size, st.st_mtime_ns):
            return cached[2]
        try:
            with open(path, "rb") as f:
                f.seek(max(st.st_size - LOG_READ_BYTES, 0))
                raw = f.read(LOG_READ_BYTES)
        except OSError as err:
            return LogTail(note=f"cannot read the log: {err.strerror or err}")
        lines = raw.decode("utf-8", errors="replace").splitlines()
        if st.st_size > LOG_READ_BYTES and lines:
            lines = lines[1:]  # the first line was cut
        kept = [
            clip(self.redactor.redact_text(line.rstrip()), LOG_LINE_CHARS)
            for line in lines
            if line.strip()
        ][-LOG_LINES:]
        tail = LogTail(lines=kept, note=None if kept else "the log is empty")
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[path] = (st.st_size, st.st_mtime_ns, tail)
        return tail


# --------------------------------------------------------------------------- observer


class Observer:
    """Builds one Observation of the served run and the other open runs."""

    def __init__(
        self,
        source: RunSource,
        run_id: int,
        *,
        logs: LocalLogs | None = None,
        feed: DatastreamFeed | None = None,
        others: bool = True,
    ) -> None:
        self.source = source
        self.run_id = run_id
        self.workflow_id = names.run_workflow_id(run_id)
        self.logs = logs or LocalLogs()
        self.feed = feed or DatastreamFeed(self.logs.hostname, self.logs.redactor)
        self.others = others
        self._last: dict[str, RunState] = {}
        self._closed: dict[str, tuple[str | None, RunState]] = {}  # frozen: (execution, state)
        self._figures: OrderedDict[str, PromptFigures] = OrderedDict()
        self._tries: dict[str, int] = {}
        self._other_ids: list[str] = []
        self._other_views: list[RunView] = []
        self._others_due = 0.0

    async def observe(self) -> Observation:
        self.feed.changed.clear()  # a frame from now on asks for the next observation
        served = await self.run(self.workflow_id, served=True)
        if self.others and time.monotonic() >= self._others_due:
            self._others_due = time.monotonic() + OTHERS_EVERY_S
            await self._refresh_others()
        return Observation(served=self.workflow_id, runs=[served, *self._other_views])

    async def _refresh_others(self) -> None:
        try:
            ids = await self.source.running_runs(MAX_OTHER_RUNS + 1)
        except SourceError as err:
            log.debug("other runs: %s", err)
            ids = self._other_ids
        self._other_ids = [i for i in ids if i != self.workflow_id][:MAX_OTHER_RUNS]
        self._other_views = [await self.run(i, served=False) for i in self._other_ids]
        keep = {self.workflow_id, *self._other_ids}
        for table in (self._last, self._closed):
            for wid in [w for w in table if w not in keep]:
                del table[wid]

    async def run(self, workflow_id: str, *, served: bool) -> RunView:
        run_id = names.run_id_from_workflow_id(workflow_id)
        note: str | None = None
        try:
            status, execution = await self.source.describe(workflow_id)
        except SourceError as err:
            status, execution, note = "unreachable", None, str(err)
        if status == "not_found":
            self._last.pop(workflow_id, None)
            return run_view(
                workflow_id, run_id, status, None, served=served, figures_of={}, logs={}
            )
        state: RunState | None
        frozen = self._closed.get(workflow_id)
        if status not in ("running", "unreachable") and frozen and frozen[0] == execution:
            state = frozen[1]  # a closed execution never changes
        elif status == "unreachable":
            state = self._last.get(workflow_id)
        else:
            try:
                state = await self.source.snapshot(workflow_id)
            except SourceError as err:
                state, note = self._last.get(workflow_id), str(err)
            else:
                self._last[workflow_id] = state
                if status != "running":
                    self._closed[workflow_id] = (execution, state)
        if state is None:
            return run_view(
                workflow_id, run_id, status, None, served=served, figures_of={}, logs={}, note=note
            )
        await self._learn_figures(workflow_id, state)
        fetches: dict[int, tuple[int, int]] = {}
        starting = any(n.handle is None for n in state.nodes)
        if status == "running" and state.plan is not None and state.plan.hub and starting:
            try:
                fetches = await self.source.fetches(workflow_id)
            except SourceError:
                pass  # shown when the nodes have started
        streamed: dict[int, LogTail] = {}
        if served:
            self.feed.follow(state.datastream)
            streamed = self.feed.tails()  # a node the datastream has lines of: those
        logs = await asyncio.to_thread(self.logs.tails, state, streamed.keys())
        logs |= streamed
        view = run_view(
            workflow_id,
            run_id,
            status,
            state,
            served=served,
            figures_of=self._figures,
            logs=logs,
            note=clip(note) if note else None,
            fetches=fetches,
        )
        if served:
            view.events = self.feed.events()
            view.datastream = self.feed.status()
        return view

    async def pace(self, interval_s: float) -> None:
        """Until the next observation: ``interval_s``, or, while the served run's
        datastream is followed, its next frame (at least ``interval_s`` apart, at most
        ``FOLLOWED_EVERY_S``: the datastream says when the run changed)."""
        await asyncio.sleep(interval_s)
        if self.feed.live and not self.feed.changed.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, FOLLOWED_EVERY_S - interval_s)):
                    await self.feed.changed.wait()

    def idle(self) -> None:
        """No page is open: stop following the datastream (a page that opens resumes)."""
        self.feed.pause()

    async def aclose(self) -> None:
        await self.feed.aclose()

    async def _learn_figures(self, run_workflow_id: str, state: RunState) -> None:
        wanted = [
            p.workflow_id
            for p in finished_prompts(state, RECENT_PROMPTS)
            if p.workflow_id is not None
            and p.workflow_id not in self._figures
            and self._tries.get(p.workflow_id, 0) < FIGURE_TRIES
        ]
        if not wanted:
            return
        if state.prompt_host is PromptHost.RUN:
            rid = {p.workflow_id: p.request_id for p in finished_prompts(state, RECENT_PROMPTS)}
            reads = [self.source.served_figures(run_workflow_id, rid[w], w) for w in wanted]
        else:
            reads = [self.source.prompt_figures(w) for w in wanted]
        results = await asyncio.gather(*reads, return_exceptions=True)
        for wid, result in zip(wanted, results, strict=True):
            if isinstance(result, PromptFigures):
                self._figures[wid] = result
                self._tries.pop(wid, None)
            else:
                self._tries[wid] = self._tries.get(wid, 0) + 1
                log.debug("figures of %s: %s", wid, result)
        while len(self._figures) > FIGURES_KEPT:
            self._figures.popitem(last=False)
        if len(self._tries) > FIGURES_KEPT:
            self._tries.clear()


# --------------------------------------------------------------------------- hub


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
        self.closed = False  # the gateway is stopping: streams end, new ones are refused

    def close(self) -> None:
        """End every open stream now (the server then stops without waiting for them)."""
        self.closed = True
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def subscribe(self) -> Subscription:
        if self.closed:
            raise ApiError(
                503, "the gateway is stopping", type="server_error", code="dashboard_closed"
            )
        if self.streams >= self.max_streams:
            raise ApiError(
                503,
                f"the dashboard has {self.max_streams} open streams already; retry later",
                type="server_error",
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
                if hub.closed:
                    break
                seen = hub.version
                assert hub.latest is not None
                yield sse_frame(hub.latest, seen)
            elif deadline - time.monotonic() > 0:
                yield b": keepalive\n\n"
    finally:
        sub.close()


# --------------------------------------------------------------------------- routes


def page() -> str:
    return resources.files("workers.gateway").joinpath("dashboard.html").read_text("utf-8")


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

        sub = self.hub.subscribe()
        return EventStream(frames(self.hub, sub), on_close=sub.aclose)


def dashboard_routes(gateway: Gateway) -> list[Route]:
    """The dashboard of the gateway's run, read from Temporal with the gateway's client;
    ``gateway.close_viewers()`` ends its streams."""
    hub = Hub(Observer(TemporalSource(gateway.client), gateway.run_id))
    gateway.viewers.append(hub.close)
    return Dashboard(hub).routes()
