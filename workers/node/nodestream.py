"""This node's own datastream (DECISIONS 93): what the node publishes of itself, and to
whom.

- ``StepStats``: the stage thread's forward steps and KV slots in use, counted as they
  happen (a lock and a few additions per step; read by the sampler).
- ``NodeDatastream``: the publisher. ``publish`` never blocks: it keeps the node's last
  ``BACKLOG_FRAMES`` frames (a follower attaching later gets them first) and queues each
  frame for every follower, each with its bound (past it, the frame is dropped for that
  follower and counted: a slow follower never slows the stage). ``serve`` runs one
  follower's connection (the data plane hands it over once its hello showed the node's
  datastream token, streamserve.py), writing the wire messages of
  ``mvp_core.node_datastream``: header, channels, frames, and the end at ``close``.
- ``LoadProgress``: the stage's weights loading, in bytes of the stage's tensors.
- ``NodeSampler``: a thread that every ``NODE_SAMPLE_S`` publishes what changed of the
  stage's steps, edges and KV slots.

Records are numbers and fixed words (``mvp_core.datastream``'s node records), redacted
anyway with the node's secrets; never prompt text.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from mvp_core.datastream import (
    CHANNEL_NODE_EDGES,
    CHANNEL_NODE_KV,
    CHANNEL_NODE_LOAD,
    CHANNEL_NODE_STEPS,
    NODE_LOAD_EVERY_S,
    NODE_SAMPLE_S,
    NodeLoadStatus,
    Redactor,
    node_edges_record,
    node_kv_record,
    node_load_record,
    node_steps_record,
)
from mvp_core.node_datastream import (
    MAX_CHANNELS,
    MAX_LINE_BYTES,
    ChannelDecl,
    FrameMsg,
    StreamEnd,
    StreamHeader,
    encode_message,
    valid_channel,
)
from workers.node.dataplane.sockets import readable_now

log = logging.getLogger("mvp.node.datastream")

BACKLOG_FRAMES = 512
FOLLOWER_FRAMES = 1_024  # frames waiting for one follower; past it, dropped and counted
SEND_TIMEOUT_S = 10.0  # a follower that takes nothing this long is let go
END_FLUSH_S = 2.0


# --------------------------------------------------------------------------- step stats


@dataclass(frozen=True, slots=True)
class StepWindow:
    """The steps of one window (since the last ``StepStats.window``)."""

    steps: int
    prefill_steps: int
    busy_s: float
    max_s: float
    largest_batch: int
    steps_total: int


class StepStats:
    """A stage's forward steps (the stage thread records) and KV slots in use."""

    def __init__(self, slots_total: int = 0) -> None:
        self._lock = threading.Lock()
        self.slots_total = int(slots_total)
        self.slots_in_use = 0  # set by the stage thread as prompts take and free slots
        self._total = 0
        self._steps = self._prefill = self._batch = 0
        self._busy = self._max = 0.0

    def record(self, seconds: float, prefill: bool, batch: int) -> None:
        with self._lock:
            self._total += 1
            self._steps += 1
            self._prefill += 1 if prefill else 0
            self._busy += seconds
            self._max = max(self._max, seconds)
            self._batch = max(self._batch, batch)

    def window(self) -> StepWindow:
        """The window so far; a new one starts."""
        with self._lock:
            out = StepWindow(
                self._steps, self._prefill, self._busy, self._max, self._batch, self._total
            )
            self._steps = self._prefill = self._batch = 0
            self._busy = self._max = 0.0
        return out


# --------------------------------------------------------------------------- publisher


class _Follower:
    __slots__ = ("dropped", "lines")

    def __init__(self) -> None:
        self.lines: deque[bytes] = deque()
        self.dropped = 0


class NodeDatastream:
    """The node's own datastream: channels, positions, the backlog, the followers."""

    def __init__(
        self,
        run_id: int,
        node_id: int,
        stage_index: int,
        *,
        redactor: Redactor | None = None,
        backlog_frames: int = BACKLOG_FRAMES,
        follower_frames: int = FOLLOWER_FRAMES,
    ) -> None:
        self.run_id, self.node_id, self.stage_index = int(run_id), int(node_id), int(stage_index)
        self._header = encode_message(StreamHeader(self.run_id, self.node_id, self.stage_index))
        self._redactor = redactor or Redactor()
        self._cond = threading.Condition()
        self._channels: dict[str, int] = {}
        self._declarations: list[bytes] = []
        self._positions: dict[str, int] = {}
        self._backlog: deque[bytes] = deque(maxlen=max(1, backlog_frames))
        self._follower_frames = max(1, follower_frames)
        self._followers: list[_Follower] = []
        self._end: bytes | None = None
        self.published = 0
        self.dropped = 0  # frames lost for some follower, or refused (too big, too many)

    @property
    def followers(self) -> int:
        with self._cond:
            return len(self._followers)

    def positions(self) -> dict[str, int]:
        """Frames published so far per channel."""
        with self._cond:
            return dict(self._positions)

    def publish(self, channel: str, record: Mapping[str, Any]) -> bool:
        """Offer a record on ``channel``; never blocks. False where it was refused (a
        channel that is not a node's, one too many, a record too big, the stream ended)."""
        body = self._redactor.redact(dict(record))
        with self._cond:
            if self._end is not None:
                return False
            cid = self._channels.get(channel)
            declaration = None
            if cid is None:
                if not valid_channel(channel) or len(self._channels) >= MAX_CHANNELS:
                    self.dropped += 1
                    log.warning("node datastream: channel %r refused", channel)
                    return False
                cid = len(self._channels)
                declaration = encode_message(ChannelDecl(channel, cid))
            position = self._positions.get(channel, 0)
            line = encode_message(FrameMsg(cid, position, body))
            if len(line) > MAX_LINE_BYTES:
                self.dropped += 1
                log.warning("node datastream: a %s record of %d bytes dropped", channel, len(line))
                return False
            if declaration is not None:
                self._channels[channel] = cid
                self._declarations.append(declaration)
            self._positions[channel] = position + 1
            self._backlog.append(line)
            self.published += 1
            for f in self._followers:
                if declaration is not None:
                    f.lines.append(declaration)  # never dropped: a frame needs its channel
                if len(f.lines) >= self._follower_frames:
                    f.dropped += 1
                    self.dropped += 1
                else:
                    f.lines.append(line)
            self._cond.notify_all()
        return True

    def close(self, reason: str = "stopped", wait_s: float = 0.0) -> None:
        """End the stream: every follower gets what is queued, then the end; waits up to
        ``wait_s`` for them to have it (before the data plane closes their sockets)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            if self._end is None:
                self._end = encode_message(StreamEnd(reason))
                self._cond.notify_all()
            while self._followers and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)

    def serve(self, sock: socket.socket, peer: str) -> None:
        """One follower's connection, until it leaves, lags past ``SEND_TIMEOUT_S``, or
        the stream ends (the data plane closes the socket after)."""
        follower = _Follower()
        with self._cond:
            follower.lines.extend([self._header, *self._declarations, *self._backlog])
            self._followers.append(follower)
        log.info("node datastream: %s follows", peer)
        sock.settimeout(SEND_TIMEOUT_S)
        try:
            while True:
                with self._cond:
                    if not follower.lines and self._end is None:
                        self._cond.wait(1.0)
                    lines = list(follower.lines)
                    follower.lines.clear()
                    end = self._end if not lines else None
                if lines:
                    sock.sendall(b"".join(lines))
                elif end is not None:
                    sock.sendall(end)
                    _linger(sock)
                    return
                elif _left(sock):
                    return
        except OSError as err:
            log.info("node datastream: %s let go: %s", peer, err)
        finally:
            with self._cond:
                self._followers.remove(follower)
                self._cond.notify_all()  # a close waiting for its followers
            if follower.dropped:
                log.info("node datastream: %s lost %d frames", peer, follower.dropped)


def _left(sock: socket.socket) -> bool:
    """Whether the follower closed (it sends nothing after its hello)."""
    try:
        return readable_now(sock) and not sock.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):
        return True


def _linger(sock: socket.socket) -> None:
    """After the end: let the follower read it and close first (bounded)."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(END_FLUSH_S)
        while sock.recv(4096):
            pass
    except OSError:
        pass


# --------------------------------------------------------------------------- load


class LoadProgress:
    """The stage's load, in bytes of its tensors (``workers.node.engine.LoadObserver``):
    ``begin`` with the stage's tensors, ``tensor(name)`` as the loader takes one up (each
    counts once), published at most every ``NODE_LOAD_EVERY_S``; the first, the last
    (``done`` or ``failed``) always."""

    def __init__(
        self,
        stream: NodeDatastream,
        layers: tuple[int, int],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream
        self._layers = layers
        self._sizes: dict[str, int] = {}
        self.total = 0
        self.loaded = 0
        self._seen: set[str] = set()
        self._clock = clock
        self._started = clock()
        self._next = 0.0
        self._lock = threading.Lock()

    def begin(self, sizes: Mapping[str, int]) -> None:
        with self._lock:
            self._sizes = dict(sizes)
            self.total = sum(self._sizes.values())
        self._publish(NodeLoadStatus.LOADING)

    def tensor(self, name: str) -> None:
        with self._lock:
            size = self._sizes.get(name)
            if size is None or name in self._seen:
                return
            self._seen.add(name)
            self.loaded += size
            due = self._clock() >= self._next
        if due:
            self._publish(NodeLoadStatus.LOADING)

    def done(self) -> None:
        """The stage is loaded: every byte of it (a tensor the loader did not take up is
        one the stage does not need)."""
        with self._lock:
            self.loaded = self.total
        self._publish(NodeLoadStatus.LOADED)

    def failed(self) -> None:
        self._publish(NodeLoadStatus.FAILED)

    def _publish(self, status: NodeLoadStatus) -> None:
        with self._lock:
            now = self._clock()
            self._next = now + NODE_LOAD_EVERY_S
            loaded, elapsed = self.loaded, int((now - self._started) * 1000)
        s = self._stream
        s.publish(
            CHANNEL_NODE_LOAD,
            node_load_record(
                s.run_id,
                s.node_id,
                s.stage_index,
                self._layers,
                loaded,
                self.total,
                status,
                elapsed,
            ),
        )


# --------------------------------------------------------------------------- sampler


class _EdgeLike(Protocol):
    @property
    def edge_id(self) -> int: ...

    @property
    def direction(self) -> str: ...

    bytes: int


class StageFigures(Protocol):
    """What the sampler reads of the node's stage (``StageRuntime``)."""

    @property
    def steps(self) -> StepStats: ...

    def edges(self) -> Collection[_EdgeLike]: ...


class NodeSampler:
    """Every ``interval_s``: the stage's steps (when it stepped), its KV slots (when they
    changed) and its edges (while bytes move, and once more when they stop), as frames of
    the node's channels."""

    def __init__(
        self,
        stream: NodeDatastream,
        stage: Callable[[], StageFigures | None],
        *,
        interval_s: float = NODE_SAMPLE_S,
    ) -> None:
        self._stream = stream
        self._stage = stage
        self._interval = interval_s
        self._stop = threading.Event()
        self._kv: tuple[int, int] | None = None
        self._edge_bytes: dict[int, int] = {}  # by id() of the edge object
        self._edges_shown: tuple[tuple[int, str], ...] = ()
        self._edges_busy = False  # the last edges frame showed bytes moving
        self._at = time.monotonic()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="node-sampler", daemon=True)

    def start(self) -> NodeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(2.0)
        self.sample()  # the last of it

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sample()
            except Exception as err:  # observation never takes the node down
                log.warning("node datastream: sampling failed: %s: %s", type(err).__name__, err)

    def sample(self, stage: StageFigures | None = None) -> None:
        """One sample of ``stage`` (the node's current one by default: a stage being
        stopped gives its last figures this way)."""
        with self._lock:
            self._sample(stage if stage is not None else self._stage())

    def _sample(self, stage: StageFigures | None) -> None:
        now = time.monotonic()
        interval_ms, self._at = int((now - self._at) * 1000), now
        if stage is None:
            return
        s = self._stream
        ids = (s.run_id, s.node_id, s.stage_index)
        w = stage.steps.window()
        if w.steps:
            s.publish(
                CHANNEL_NODE_STEPS,
                node_steps_record(
                    *ids,
                    interval_ms=interval_ms,
                    steps=w.steps,
                    prefill_steps=w.prefill_steps,
                    busy_ms=w.busy_s * 1000,
                    max_ms=w.max_s * 1000,
                    largest_batch=w.largest_batch,
                    steps_total=w.steps_total,
                ),
            )
        kv = (stage.steps.slots_in_use, stage.steps.slots_total)
        if kv != self._kv:
            self._kv = kv
            s.publish(CHANNEL_NODE_KV, node_kv_record(*ids, *kv))
        edges = list(stage.edges())
        seen: dict[int, int] = {}
        rate = {"in": 0, "out": 0}
        for e in edges:
            n = e.bytes
            seen[id(e)] = n
            rate[e.direction] = rate.get(e.direction, 0) + max(
                0, n - self._edge_bytes.get(id(e), 0)
            )
        shown = tuple((e.edge_id, e.direction) for e in edges)
        busy = any(rate.values())
        if busy or self._edges_busy or shown != self._edges_shown:  # a stop shows as 0 B/s
            secs = max(interval_ms, 1) / 1000
            s.publish(
                CHANNEL_NODE_EDGES,
                node_edges_record(
                    *ids,
                    interval_ms=interval_ms,
                    in_bytes_per_s=rate["in"] / secs,
                    out_bytes_per_s=rate["out"] / secs,
                    edges=[(e.edge_id, e.direction, seen[id(e)]) for e in edges],
                ),
            )
        self._edge_bytes, self._edges_shown, self._edges_busy = seen, shown, busy
