"""The dashboard's observer: one ``Observation`` of the served run (and, in the gateway,
the other open runs), from the reads of ``sources`` and the served run's datastream
(``feed``), and the tails of node logs on this host (``LocalLogs``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Collection

from mvp_core import names
from mvp_core.datastream import Redactor
from mvp_core.models import NodeHandle, PromptHost, RunPhase
from mvp_core.run_state import RunState
from workers.dashboard.facts import node_condition, overlay, told_stopping
from workers.dashboard.feed import DatastreamFeed
from workers.dashboard.sources import RunSource, SourceError
from workers.dashboard.view import (
    RECENT_PROMPTS,
    LogTail,
    Observation,
    PromptFigures,
    RunStatus,
    RunView,
    StageState,
    clip,
    finished_prompts,
    run_view,
)

log = logging.getLogger("mvp.dashboard")

INTERVAL_S = 0.5  # how often the served run is read while a page is open
OTHERS_EVERY_S = 3.0  # how often other open runs are listed and read
# While the served run's datastream is followed, its frames say when to read the run
# again; without one for this long, it is read anyway (a change the datastream does not
# carry: the prompt queue between admissions).
FOLLOWED_EVERY_S = 2.0
# While it is followed, the datastream feeds the served run's state (workers.dashboard
# .facts) and the snapshot is read only for what the stream does not carry: when a frame
# tells of such a change (a plan, a prompt admitted or ended, a new node; at most every
# SNAPSHOT_ASKED_S) and otherwise every SNAPSHOT_EVERY_S.
SNAPSHOT_EVERY_S = 10.0
SNAPSHOT_ASKED_S = 2.0
MAX_OTHER_RUNS = 7
FIGURES_KEPT = 256  # finished prompts whose figures are cached
FIGURE_TRIES = 3  # a prompt whose history cannot be read after this many tries goes without
LOG_LINES = 12
LOG_LINE_CHARS = 240
LOG_READ_BYTES = 16 * 1024


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
        # The served run's last read (status, execution, note, state) and when it was made.
        self._served: tuple[RunStatus, str | None, str | None, RunState | None] | None = None
        self._served_at = 0.0
        self.snapshots = 0  # reads of the served run (describe and snapshot)

    async def observe(self, *, final: bool = False) -> Observation:
        """One observation; ``final``: the served run is read now, whatever the pace."""
        self.feed.changed.clear()  # a frame from now on asks for the next observation
        served = await self.run(self.workflow_id, served=True, fresh=final)
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

    def _read_due(self) -> bool:
        """Whether the served run is read now: always without a live datastream (as before
        one was followed); with one, when a frame asked for it or SNAPSHOT_EVERY_S passed."""
        if self._served is None or not self.feed.live:
            return True
        since = time.monotonic() - self._served_at
        facts = self.feed.facts
        state = self._served[3]
        asked = facts.wants_snapshot or (state is not None and facts.knows_more_nodes_than(state))
        return since >= SNAPSHOT_EVERY_S or (asked and since >= SNAPSHOT_ASKED_S)

    async def run(self, workflow_id: str, *, served: bool, fresh: bool = False) -> RunView:
        run_id = names.run_id_from_workflow_id(workflow_id)
        if served:
            if fresh or self._read_due():
                self.feed.facts.wants_snapshot = False  # a frame from now on asks again
                self._served = await self._read(workflow_id)
                self._served_at = time.monotonic()
                self.snapshots += 1
            status, _, note, state = self._served or ("unreachable", None, None, None)
        else:
            status, _, note, state = await self._read(workflow_id)
        if status == "not_found":
            return run_view(
                workflow_id, run_id, status, None, served=served, figures_of={}, logs={}
            )
        if state is None:
            return run_view(
                workflow_id, run_id, status, None, served=served, figures_of={}, logs={}, note=note
            )
        conditions: dict[int, StageState] = {}
        stopping = False
        if served:
            # What the datastream told since the snapshot, laid over it (facts.py).
            facts = self.feed.facts
            stopping = told_stopping(state, facts)
            state = overlay(state, facts)
            ready = state.phase is RunPhase.PROMPT_READY
            conditions = {
                n.node_id: node_condition(n, facts.nodes.get(n.node_id), ready)
                for n in state.nodes
                if n.node_id in facts.nodes
            }
        view = await self._view(workflow_id, run_id, status, state, served, note, conditions)
        view.stopping = view.stopping or stopping
        return view

    async def _read(
        self, workflow_id: str
    ) -> tuple[RunStatus, str | None, str | None, RunState | None]:
        """A run's status and snapshot (a closed execution's is read once), and a note
        when either did not answer."""
        note: str | None = None
        try:
            status, execution = await self.source.describe(workflow_id)
        except SourceError as err:
            status, execution, note = "unreachable", None, str(err)
        if status == "not_found":
            self._last.pop(workflow_id, None)
            return status, execution, note, None
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
        return status, execution, note, state

    async def _view(
        self,
        workflow_id: str,
        run_id: int | None,
        status: RunStatus,
        state: RunState,
        served: bool,
        note: str | None,
        conditions: dict[int, StageState],
    ) -> RunView:
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
            conditions=conditions,
            own=self.feed.node_figures() if served else None,
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
