"""The dashboard's view of a run's datastream (DECISIONS 58): the served run's live
frames, followed from the address its datastream activity told the run.

The run's snapshot says where its datastream is served (``RunState.datastream``: a
loopback port or a unix socket on the host of the worker that runs the activity). When
that host is the gateway's, a ``DatastreamFeed`` follows it: the datastream first sends
the frames its attempt has published so far, then each new one. The feed keeps what the
page shows of them, bounded:

- each node's last log lines (``mvp.provisioning.logs.node.<id>.<stdout|stderr|provider>``:
  its output, its stderr, and its provider's progress: rent, SSH, bootstrap, waits);
- the run's last events, one line each (bootstrap phases, provisioning events, lifecycle
  reports, membership, stage routes);
- each node's latest figures from its own channels (``mvp.node.*``, DECISIONS 93: load,
  steps, KV slots, edge rates), by the node of the frame's stream.

Everything is redacted again with the gateway's own secrets (the datastream redacts with
the worker's). A frame wakes whoever waits on ``changed`` (the dashboard's poller: the
datastream, not a timer, says when the run changed). The feed never controls anything and
never fails the dashboard: a stream that cannot be reached, or that ends, is a ``note``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections import deque
from typing import Any

from mvp_core import datastream as ds
from mvp_core.models import DatastreamAddress
from mvp_io.datastream import parse_address
from workers.dashboard.facts import StreamFacts
from workers.dashboard.view import FeedEvent, LogTail, NodeFigures, clip, node_figures

LOG_LINES = 12  # per node
EVENTS = 32  # the run's last events
LINE_CHARS = 240
RECONNECT_S = 5.0  # after a stream that could not be reached
YIELD_EVERY = 256  # frames read between two turns given back to the event loop
READ_LIMIT = 4 * 1024 * 1024  # the longest frame line read (a datastream frame is < 1 MiB)
_STREAM_TAG = {"Stdout": "", "Stderr": "[stderr] ", "Provider": "[provider] "}


def event_text(channel: str, record: Any) -> str | None:
    """One line for a record of the run's own channels; None for what is not an event
    (log lines, the datastream's own health)."""
    if not isinstance(record, dict):
        return None
    kind = record.get("type")
    if channel == ds.CHANNEL_BOOTSTRAP and kind == "OrchBootstrap":
        if record.get("phase") == ds.BootstrapPhase.DATASTREAM.value:
            return None
        node = record.get("node_id")
        who = f"node {node} " if node else ""
        return f"{who}{record.get('phase')} {record.get('status')}{_detail(record.get('detail'))}"
    if channel == ds.CHANNEL_LIFECYCLE and kind == "OrchLifecycle":
        rid = record.get("request_id")
        prompt = f" prompt {rid}" if rid is not None else ""
        detail = record.get("detail") or ""
        return f"{record.get('kind')}{prompt}" + (f": {detail}" if detail else "")
    if channel == ds.CHANNEL_PROVISIONING_EVENTS and isinstance(record.get("event"), dict):
        e = record["event"]
        message = e.get("message") or ""
        return f"node {e.get('node_id')} {e.get('kind')} ({e.get('provider')})" + (
            f": {message}" if message else ""
        )
    if channel == ds.CHANNEL_MEMBERSHIP and kind == "SwimMembership":
        return f"node {record.get('node_id')} {record.get('state')}"
    if channel == ds.CHANNEL_STAGE_ROUTE and kind == "OrchStageRoute":
        return (
            f"node {record.get('node_id')} stage {record.get('stage_index')} route "
            f"{record.get('status')}" + (f": {record['detail']}" if record.get("detail") else "")
        )
    return None


def _detail(detail: Any) -> str:
    if not detail:
        return ""
    if isinstance(detail, str):
        return f": {detail}"
    return f": {json.dumps(detail, separators=(',', ':'), sort_keys=True)}"


def node_of_log_channel(channel: str) -> int | None:
    """The node id of ``mvp.provisioning.logs.node.<id>.<stream>``, else None."""
    if not channel.startswith(ds.NODE_LOG_CHANNEL_PREFIX):
        return None
    head = channel[len(ds.NODE_LOG_CHANNEL_PREFIX) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def node_of_stream(stream: str) -> int | None:
    """The node id of ``mvp-node-<run_id>-<node_id>``, else None."""
    head, _, node = stream.rpartition("-")
    return int(node) if head.startswith("mvp-node-") and node.isdigit() else None


class DatastreamFeed:
    """Follows one run's datastream at a time (see the module doc)."""

    def __init__(
        self,
        hostname: str | None = None,
        redactor: ds.Redactor | None = None,
        *,
        log_lines: int = LOG_LINES,
        events: int = EVENTS,
        reconnect_s: float = RECONNECT_S,
    ) -> None:
        self.hostname = hostname or socket.gethostname()
        self.redactor = redactor or ds.Redactor.from_env(os.environ)
        self.log_lines = log_lines
        self.reconnect_s = reconnect_s
        self.address: str | None = None  # the stream followed (or last tried)
        self.live = False  # connected now
        self.ended = False  # the stream closed: what was read is all there is
        self.note: str | None = None  # why there is no live stream
        self.frames = 0  # frames read from the current stream
        self._lines: dict[int, deque[str]] = {}
        self._own: dict[int, NodeFigures] = {}  # each node's figures from its own channels
        self._events: deque[FeedEvent] = deque(maxlen=events)
        self.facts = StreamFacts()  # the run's state as the stream tells it (facts.py)
        self._task: asyncio.Task[None] | None = None
        self._retry_at = 0.0
        self.changed = asyncio.Event()  # set on each frame; the waiter clears it

    # -- what the page shows

    def tails(self) -> dict[int, LogTail]:
        return {
            node: LogTail(lines=list(lines), source="datastream")
            for node, lines in self._lines.items()
            if lines
        }

    def node_figures(self) -> dict[int, NodeFigures]:
        return dict(self._own)

    def events(self) -> list[FeedEvent]:
        return list(self._events)

    def status(self) -> str | None:
        """A line on the page: the stream followed, or why none is."""
        if self.live:
            return f"following the run's datastream at {self.address}"
        if self.ended:
            return f"the run's datastream at {self.address} ended"
        return self.note

    # -- following

    def follow(self, found: DatastreamAddress | None) -> None:
        """Follow ``found`` (the snapshot's latest), if it is on this host and not the one
        followed already; a new address (a retried activity, a continued run) replaces
        the old one."""
        if found is None:
            if self.address is None:
                self.note = "the run has told no datastream yet"
            return
        if found.host and found.host != self.hostname:
            self._stop()
            self.address = found.address
            self.note = f"the run's datastream is on host {found.host}: not readable from here"
            return
        if found.address == self.address and (self._task is not None or self.ended):
            return
        if found.address == self.address and time.monotonic() < self._retry_at:
            return
        self._stop()
        self.address = found.address
        self.ended = False
        self._task = asyncio.ensure_future(self._run(found.address))

    def pause(self) -> None:
        """Stop reading; ``follow`` resumes (the stream sends its frames again)."""
        self._stop()
        self._retry_at = 0.0

    def _stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        self.live = False

    async def aclose(self) -> None:
        task, self._task = self._task, None
        self.live = False
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self, address: str) -> None:
        try:
            await self._read(address)
        finally:
            self.live = False
            if self._task is asyncio.current_task():
                self._task = None
            self.changed.set()

    async def _read(self, address: str) -> None:
        try:
            family, sockaddr = parse_address(address)
            if family == socket.AF_UNIX:
                reader, writer = await asyncio.open_unix_connection(sockaddr, limit=READ_LIMIT)
            else:
                reader, writer = await asyncio.open_connection(
                    sockaddr[0], sockaddr[1], limit=READ_LIMIT
                )
        except (OSError, ValueError) as err:
            self.note = clip(f"cannot follow the run's datastream at {address}: {err}")
            self._retry_at = time.monotonic() + self.reconnect_s
            return
        # The stream starts with everything its attempt published: start afresh.
        self._lines.clear()
        self._own.clear()
        self._events.clear()
        self.facts = StreamFacts()
        self.frames = 0
        self.live, self.note = True, None
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # a frame past READ_LIMIT (LimitOverrunError): skipped
                    continue
                if not line:
                    break
                if line.endswith(b"\n"):
                    self.absorb(line)
                if self.frames % YIELD_EVERY == 0:
                    # A replay of thousands of buffered frames never holds the gateway's
                    # event loop (its completions stream on it) for long.
                    await asyncio.sleep(0)
            self.ended = True
        except OSError as err:
            self.note = clip(f"the run's datastream at {address} broke: {err}")
            self._retry_at = time.monotonic() + self.reconnect_s
        finally:
            writer.close()

    def absorb(self, raw: bytes) -> None:
        """Take one frame line (undecodable lines are skipped)."""
        try:
            frame = json.loads(raw)
            channel = str(frame["channel"])
            record = ds.decode_payload(frame)
            at_ms = int(frame.get("arrival_unix_ms") or 0)
        except (ValueError, KeyError, TypeError):
            return
        self.frames += 1
        if channel.startswith(ds.NODE_CHANNEL_PREFIX):
            node = node_of_stream(str(frame.get("stream", "")))
            got = None if node is None else node_figures(self._own.get(node), channel, record)
            if node is not None and got is not None:
                self._own[node] = got
                self.changed.set()
            return
        node = node_of_log_channel(channel)
        if node is not None:
            body = record.get("line") if isinstance(record, dict) else None
            if not isinstance(body, dict) or not str(body.get("line", "")).strip():
                return
            tag = _STREAM_TAG.get(str(body.get("stream")), "")
            text = clip(self.redactor.redact_text(tag + str(body["line"]).rstrip()), LINE_CHARS)
            self._lines.setdefault(node, deque(maxlen=self.log_lines)).append(text)
        else:
            fact = self.facts.absorb(channel, record)
            text_or_none = event_text(channel, record)
            if text_or_none is None:
                if fact:
                    self.changed.set()
                return
            text = clip(self.redactor.redact_text(text_or_none), LINE_CHARS)
            self._events.append(FeedEvent(at_ms=at_ms, channel=channel, text=text))
        self.changed.set()
