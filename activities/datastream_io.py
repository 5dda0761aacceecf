"""A run's datastream: publish records, fan frames out to sinks, never block.

Used by the run datastream activity (``activities/datastream.py``) and the process host.

``Datastream.publish`` redacts a record, turns it into a frame of its stream (channel id,
position, arrival time; ``mvp_core.datastream``) and offers it to every sink. A sink owns
a bounded queue and its own thread: when the queue is full the frame is dropped for that
sink and counted, so a slow disk or a stuck subscriber never slows the run (the
datastream is observational, process spec 8.15, 9.18). ``close`` flushes with a bound.

Sinks:

- ``FrameArchive(path)``: the frame archive (process spec 7.13, 8.12): JSON lines,
  appended, parent directories made, flushed after each line; ``arrival_seq`` continues
  from the existing file's line count.
- ``LiveSubscribers(address)``: a loopback TCP (``127.0.0.1:<port>``, 0 = any free port)
  or unix-socket (``unix:<path>``) server; every attached subscriber gets every frame from
  attach time on, as the archive's JSON lines (``arrival_seq`` there is the datastream's
  publish sequence, so a gap shows what that subscriber lost). A subscriber that does not
  keep up loses frames (counted), it never slows the others or the run.

``LogTailer`` follows a node's log file and publishes its lines as log records.
``workers/host/follow.py`` is the subscriber side; ``activities/datastream.py`` the run's activity (``python -m workers.host.follow``).

Host wiring (sketch)::

    redactor = Redactor.from_env(os.environ, extra=[vastai_api_key])
    sinks = [FrameArchive(path)] if frame_log else []
    live = LiveSubscribers("127.0.0.1:0"); sinks.append(live)
    ds = Datastream(run_id=run_id, node_id=node_id, sinks=sinks, redactor=redactor)
    ds.bootstrap("config", "ready", {"provider": "process", "vastai_api_key": bool(key)})
    tail = LogTailer(ds, handle.log_path, node_id=3).start()
    ...
    tail.stop(); ds.close()
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import selectors
import socket
import stat
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from mvp_core.datastream import (
    CHANNEL_BOOTSTRAP,
    CHANNEL_LIFECYCLE,
    CHANNEL_MEMBERSHIP,
    CHANNEL_PROMPT,
    CHANNEL_PROVISIONING_EVENTS,
    CHANNEL_STAGE_ROUTE,
    CORE_CHANNELS,
    SOURCE_NODE_LOG,
    SOURCE_ORCHESTRATOR,
    BootstrapPhase,
    BootstrapStatus,
    ChannelRegistry,
    Frame,
    LogStream,
    MembershipState,
    ProvisionEventKind,
    Redactor,
    drops_record,
    encode_frame_line,
    encode_record,
    lifecycle_record,
    log_line,
    membership_record,
    node_log_channel,
    node_stream_id,
    orch_bootstrap,
    orch_prompt_event,
    orchestrator_stream_id,
    provision_event,
    stage_route_record,
    stdio_channel,
)
from mvp_core.models import LifecycleReport

DEFAULT_QUEUE_FRAMES = 10_000
DEFAULT_CLOSE_TIMEOUT_S = 5.0
DEFAULT_SUMMARY_INTERVAL_S = 30.0

# --------------------------------------------------------------------------- addresses

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def parse_address(address: str) -> tuple[socket.AddressFamily, Any]:
    """``unix:<path>`` (or a path holding ``/``) -> (AF_UNIX, path);
    ``<host>:<port>``, ``[<ipv6>]:<port>`` or ``<port>`` -> (AF_INET/AF_INET6, (host, port)),
    the host defaulting to 127.0.0.1. A ``ValueError`` names what is wrong."""
    if address.startswith("unix:"):
        path = address[len("unix:") :]
        if not path:
            raise ValueError(f"invalid datastream address {address!r}: empty socket path")
        return socket.AF_UNIX, path
    if "/" in address:
        return socket.AF_UNIX, address
    host, sep, port_text = address.rpartition(":")
    if not sep:
        host, port_text = "127.0.0.1", address
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"invalid datastream address {address!r}: port is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"invalid datastream address {address!r}: port out of range")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return family, (host, port)


def format_address(family: socket.AddressFamily, sockaddr: Any) -> str:
    if family == socket.AF_UNIX:
        return f"unix:{sockaddr}"
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --------------------------------------------------------------------------- sinks


class Sink(ABC):
    """A frame consumer with a bounded queue, drained by its own thread.

    ``offer`` never blocks: a full queue (or a closed sink) drops the frame and counts it.
    """

    def __init__(self, name: str, capacity: int = DEFAULT_QUEUE_FRAMES) -> None:
        if capacity < 1:
            raise ValueError("sink capacity must be at least 1")
        self.name = name
        self._capacity = capacity
        self._lock = threading.Lock()
        self._queue: deque[Frame] = deque()
        self._queue_drops = 0
        self._accepting = True
        self._closing = False
        self._abandoned = False
        self._thread: threading.Thread | None = None

    # -- producer side (any thread)

    def offer(self, frame: Frame, *, force: bool = False) -> bool:
        """Queue a frame; False (and counted) if the queue is full or the sink closed.
        ``force`` admits one frame past the bound (the datastream's own summaries)."""
        with self._lock:
            if not self._accepting or (len(self._queue) >= self._capacity and not force):
                self._queue_drops += 1
                return False
            self._queue.append(frame)
            wake = self._note_queued()
        if wake:
            self._wake()
        return True

    @property
    def dropped(self) -> int:
        """Frames this sink lost: queue overflow, frames left at close, write failures."""
        with self._lock:
            return self._queue_drops + self._extra_drops()

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Stop accepting, write what is queued within ``timeout_s``, then stop; frames
        not written by then are counted as dropped."""
        with self._lock:
            self._accepting = False
            self._closing = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(max(0.0, timeout_s))
            if self._thread.is_alive():
                with self._lock:
                    self._abandoned = True
                    self._queue_drops += len(self._queue)
                    self._queue.clear()
                self._wake()
        self._closed()

    # -- consumer side (the sink's thread)

    def _start(self, target_name: str) -> None:
        self._thread = threading.Thread(target=self._run_safely, name=target_name, daemon=True)
        self._thread.start()

    def _run_safely(self) -> None:
        try:
            self._run()
        finally:
            with self._lock:
                self._queue_drops += len(self._queue)
                self._queue.clear()
                self._accepting = False

    def _take(self, limit: int) -> list[Frame]:
        with self._lock:
            out: list[Frame] = []
            while self._queue and len(out) < limit:
                out.append(self._queue.popleft())
            return out

    def _note_queued(self) -> bool:  # under the lock: does the consumer need a wake-up?
        return True

    def _extra_drops(self) -> int:  # under the lock
        return 0

    @abstractmethod
    def _wake(self) -> None: ...

    @abstractmethod
    def _run(self) -> None: ...

    def _closed(self) -> None:
        return None


class FrameArchive(Sink):
    """The frame archive: one JSON object per line, appended and flushed per record.

    ``arrival_seq`` of the first new line is the number of lines already in the file (a
    last line without its newline is completed first and counted). Opening errors raise
    here, in the caller; a write error later counts the frame as dropped and goes on."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int = DEFAULT_QUEUE_FRAMES,
        name: str = "archive",
    ) -> None:
        super().__init__(name, capacity)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+b")  # the sink's thread owns it
        try:
            self._next_seq = self._count_lines()
        except BaseException:
            self._file.close()
            raise
        self._cond = threading.Condition(self._lock)
        self._write_errors = 0
        self._written = 0
        self._start(f"datastream-archive-{self.path.name}")

    def _count_lines(self) -> int:
        f = self._file
        f.seek(0)
        count = 0
        last = b""
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
        if last and last != b"\n":
            f.write(b"\n")  # complete a torn last line so the next record starts clean
            f.flush()
            count += 1
        return count

    @property
    def next_arrival_seq(self) -> int:
        with self._lock:
            return self._next_seq

    @property
    def written(self) -> int:
        with self._lock:
            return self._written

    def _note_queued(self) -> bool:
        self._cond.notify()
        return False

    def _wake(self) -> None:
        with self._lock:
            self._cond.notify()

    def _extra_drops(self) -> int:
        return self._write_errors

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._queue and not self._closing:
                        self._cond.wait()
                    if self._abandoned or (self._closing and not self._queue):
                        return
                for frame in self._take(256):
                    with self._lock:
                        if self._abandoned:
                            return
                        seq = self._next_seq
                    line = (encode_frame_line(frame, seq) + "\n").encode("utf-8")
                    try:
                        self._file.write(line)
                        self._file.flush()
                    except (OSError, ValueError):
                        with self._lock:
                            self._write_errors += 1
                        continue
                    with self._lock:
                        self._next_seq += 1
                        self._written += 1
        finally:
            with contextlib.suppress(OSError):
                self._file.close()


class _Subscriber:
    __slots__ = ("dropped", "lines", "out", "pending_bytes", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lines: deque[bytes] = deque()
        self.out = bytearray()
        self.pending_bytes = 0
        self.dropped = 0


class LiveSubscribers(Sink):
    """A loopback server of live frames (see the module doc). ``address`` is where it
    listens once made (the real port when 0 was asked); bind errors raise here.

    Each subscriber has its own bound (``subscriber_frames`` lines and
    ``subscriber_bytes`` bytes waiting); past it, frames are lost for that subscriber
    and counted in ``dropped``. At most ``max_subscribers`` attach at once; more are
    closed at once (counted in ``rejected``)."""

    _SEND_CHUNK = 256 * 1024
    _BUSY_TICK_S = 0.005

    def __init__(
        self,
        address: str = "127.0.0.1:0",
        *,
        capacity: int = DEFAULT_QUEUE_FRAMES,
        subscriber_frames: int = DEFAULT_QUEUE_FRAMES,
        subscriber_bytes: int = 8 * 1024 * 1024,
        max_subscribers: int = 64,
        close_flush_s: float = 1.0,
        name: str = "subscribers",
        replay_frames: int = 0,
    ) -> None:
        super().__init__(name, capacity)
        # The last ``replay_frames`` frames, sent to each subscriber first when it attaches
        # (a run's datastream: a follower coming late still sees the run from its start).
        self._backlog: deque[bytes] = deque(maxlen=max(0, replay_frames))
        self._subscriber_frames = subscriber_frames
        self._subscriber_bytes = subscriber_bytes
        self._max_subscribers = max_subscribers
        self._close_flush_s = close_flush_s
        self._subs: dict[int, _Subscriber] = {}
        self._sub_drops = 0
        self._rejected = 0
        self._attached_total = 0
        self._wake_pending = False
        self._unix_path: str | None = None
        self._unix_ino: tuple[int, int] | None = None
        family, sockaddr = parse_address(address)
        self._listener = self._listen(family, sockaddr)
        self.address = format_address(
            family, self._unix_path if family == socket.AF_UNIX else self._listener.getsockname()
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._start(f"datastream-live-{self.address}")

    def _listen(self, family: socket.AddressFamily, sockaddr: Any) -> socket.socket:
        if family == socket.AF_UNIX:
            path = os.path.abspath(str(sockaddr))
            self._clear_stale_socket(path)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(path)
                os.chmod(path, 0o600)  # subscribers run as the host's user
                st = os.stat(path)
                self._unix_path, self._unix_ino = path, (st.st_dev, st.st_ino)
                sock.listen(64)
            except BaseException:
                sock.close()
                raise
        else:
            host = sockaddr[0]
            if host not in _LOOPBACK_HOSTS:
                raise ValueError(
                    f"datastream subscribers listen on loopback only (127.0.0.1, ::1), not {host}"
                )
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(sockaddr)
                sock.listen(64)
            except BaseException:
                sock.close()
                raise
        sock.setblocking(False)
        return sock

    @staticmethod
    def _clear_stale_socket(path: str) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(errno.EEXIST, "exists and is not a socket", path)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(0.5)
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a leftover of a dead host
            return
        finally:
            probe.close()
        raise OSError(errno.EADDRINUSE, "another process serves this datastream socket", path)

    # -- counters

    @property
    def subscriber_count(self) -> int:
        with self._lock:
            return len(self._subs)

    @property
    def attached_total(self) -> int:
        with self._lock:
            return self._attached_total

    @property
    def rejected(self) -> int:
        with self._lock:
            return self._rejected

    def _extra_drops(self) -> int:
        return self._sub_drops

    # -- wake-ups

    def _note_queued(self) -> bool:
        if self._wake_pending:
            return False
        self._wake_pending = True
        return True

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    # -- the loop

    def _run(self) -> None:
        flush_deadline: float | None = None
        timeout = 0.5
        try:
            while True:
                with self._lock:
                    closing, abandoned = self._closing, self._abandoned
                if abandoned:
                    return
                if closing and flush_deadline is None:
                    flush_deadline = time.monotonic() + self._close_flush_s
                try:
                    moved = self._step(timeout)
                except Exception:  # observation must not die: pause, then go on
                    moved = 0
                    time.sleep(0.05)
                if moved:
                    # Busy: look again soon without asking producers for wake-ups (one
                    # syscall per frame would cost the publisher more than the frame).
                    timeout = self._BUSY_TICK_S
                else:
                    with self._lock:
                        if not self._queue:
                            self._wake_pending = False  # idle: the next offer wakes us
                        idle = not self._queue
                    timeout = (0.02 if closing else 0.5) if idle else 0.0
                if flush_deadline is not None:
                    with self._lock:
                        empty = not self._queue
                        subs = list(self._subs.values())
                    if empty and all(not s.lines and not s.out for s in subs):
                        return
                    if time.monotonic() >= flush_deadline:
                        return  # what is left is counted as lost
        finally:
            self._shutdown()

    def _step(self, timeout: float) -> int:
        """One turn: accept, read, take queued frames to subscribers, write; returns how
        many frames it took."""
        for key, mask in self._sel.select(timeout):
            if key.data == "listen":
                self._accept()
            elif key.data == "wake":
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass
            else:
                sub: _Subscriber = key.data
                if mask & selectors.EVENT_READ:
                    self._read(sub)
                if mask & selectors.EVENT_WRITE and sub.sock.fileno() in self._subs:
                    self._flush(sub)
        moved = 0
        for _ in range(8):  # bounded work per step, so accepts and writes keep going
            frames = self._take(1024)
            if not frames:
                break
            moved += len(frames)
            self._fan_out(frames)
        with self._lock:
            subs = list(self._subs.values())
        for sub in subs:
            if sub.lines or sub.out:
                self._flush(sub)
        return moved

    def _accept(self) -> None:
        for _ in range(64):
            try:
                conn, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            with self._lock:
                full = len(self._subs) >= self._max_subscribers
                if full:
                    self._rejected += 1
            if full:
                conn.close()
                continue
            conn.setblocking(False)
            sub = _Subscriber(conn)
            if self._backlog:  # the sink's thread owns the backlog: no frame missed or twice
                kept = list(self._backlog)[-self._subscriber_frames :]
                sub.dropped += len(self._backlog) - len(kept)
                sub.lines.extend(kept)
                sub.pending_bytes += sum(len(line) for line in kept)
                events = selectors.EVENT_READ | selectors.EVENT_WRITE
            else:
                events = selectors.EVENT_READ
            self._sel.register(conn, events, sub)
            with self._lock:
                self._subs[conn.fileno()] = sub
                self._attached_total += 1

    def _read(self, sub: _Subscriber) -> None:
        try:
            data = sub.sock.recv(4096)  # subscribers have nothing to say: discard it
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop_subscriber(sub)

    def _fan_out(self, frames: Sequence[Frame]) -> None:
        with self._lock:
            subs = list(self._subs.values())
        if not subs and self._backlog.maxlen == 0:
            return
        lost = 0
        for frame in frames:
            line = (encode_frame_line(frame, frame.seq) + "\n").encode("utf-8")
            if self._backlog.maxlen:
                self._backlog.append(line)
            for sub in subs:
                if (
                    len(sub.lines) >= self._subscriber_frames
                    or sub.pending_bytes + len(line) > self._subscriber_bytes
                ):
                    sub.dropped += 1
                    lost += 1
                    continue
                sub.lines.append(line)
                sub.pending_bytes += len(line)
        if lost:
            with self._lock:
                self._sub_drops += lost

    def _flush(self, sub: _Subscriber) -> None:
        try:
            while True:
                if not sub.out:
                    while sub.lines and len(sub.out) < self._SEND_CHUNK:
                        line = sub.lines.popleft()
                        sub.pending_bytes -= len(line)
                        sub.out += line
                    if not sub.out:
                        break
                n = sub.sock.send(sub.out, socket.MSG_NOSIGNAL)
                del sub.out[:n]
                if sub.out:
                    break  # the kernel's buffer is full
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop_subscriber(sub)
            return
        events = selectors.EVENT_READ
        if sub.out or sub.lines:
            events |= selectors.EVENT_WRITE
        with contextlib.suppress(KeyError, ValueError):
            self._sel.modify(sub.sock, events, sub)

    def _drop_subscriber(self, sub: _Subscriber) -> None:
        with self._lock:
            fd = sub.sock.fileno()
            if self._subs.get(fd) is not sub:
                return
            del self._subs[fd]
            lost = len(sub.lines) + (1 if sub.out else 0)
            self._sub_drops += lost
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sub.sock)
        with contextlib.suppress(OSError):
            sub.sock.close()

    def _shutdown(self) -> None:
        with self._lock:
            subs = list(self._subs.values())
        for sub in subs:
            with contextlib.suppress(OSError):
                sub.sock.shutdown(socket.SHUT_WR)
            self._drop_subscriber(sub)
        with contextlib.suppress(Exception):
            self._sel.close()
        for s in (self._listener, self._wake_r):
            with contextlib.suppress(OSError):
                s.close()
        if self._unix_path is not None:
            with contextlib.suppress(OSError):
                st = os.stat(self._unix_path)
                if (st.st_dev, st.st_ino) == self._unix_ino:
                    os.unlink(self._unix_path)

    def _closed(self) -> None:
        # the loop closes everything it owns; the wake socket's writer is ours
        if self._thread is None or not self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._wake_w.close()


# --------------------------------------------------------------------------- datastream


class Datastream:
    """The host's datastream (process spec 7.12): one per orchestrator process and run.

    ``publish`` is safe from any thread and never blocks on a sink. Records are redacted
    before anything leaves the process. Every ``summary_interval_s`` (checked on publish)
    and at close, if any sink lost frames since the last summary, a drops record is
    published on ``mvp.orch.bootstrap`` (phase ``datastream``); close always publishes a
    final one (``"final": true``) with the count of frames published."""

    def __init__(
        self,
        *,
        run_id: int,
        node_id: int,
        sinks: Iterable[Sink] = (),
        redactor: Redactor | None = None,
        summary_interval_s: float | None = DEFAULT_SUMMARY_INTERVAL_S,
        stream: str | None = None,
    ) -> None:
        self.run_id = int(run_id)
        self.node_id = int(node_id)
        # The stream of its own records: the run's (``mvp-orchestrator-<run_id>``) unless
        # told otherwise (the process host's own, beside the run's frames it forwards).
        self.stream = stream or orchestrator_stream_id(self.run_id)
        self.redactor = redactor if redactor is not None else Redactor()
        self._sinks: list[Sink] = []
        names: set[str] = set()
        for sink in sinks:
            if sink.name in names:
                raise ValueError(f"two datastream sinks are named {sink.name!r}")
            names.add(sink.name)
            self._sinks.append(sink)
        self._lock = threading.Lock()
        self._registry = ChannelRegistry()
        self._registry.register(self.stream, CORE_CHANNELS)
        self._seq = 0
        self._closed = False
        self._after_close = 0
        self._summary_interval_s = summary_interval_s
        self._next_summary = time.monotonic() + (summary_interval_s or 0.0)
        self._summary_lock = threading.Lock()
        self._reported_drops: dict[str, int] = {s.name: 0 for s in self._sinks}

    # -- publishing

    def publish(
        self,
        channel: str,
        record: Any,
        *,
        source: str = SOURCE_ORCHESTRATOR,
        stream: str | None = None,
    ) -> None:
        """Publish a record (JSON-like; or ``str``/``bytes`` as a raw payload) on
        ``channel`` of ``stream`` (the orchestrator's by default)."""
        self._publish(channel, record, source=source, stream=stream, force=False)
        if self._summary_interval_s is not None and time.monotonic() >= self._next_summary:
            self._maybe_summary(final=False)

    def _publish(
        self, channel: str, record: Any, *, source: str, stream: str | None, force: bool
    ) -> None:
        redact = self.redactor.redact_text  # names too: providers may name channels
        payload = encode_record(self.redactor.redact(record))
        now_ms = time.time_ns() // 1_000_000
        stream_id = redact(stream) if stream else self.stream
        channel, source = redact(channel), redact(source)
        with self._lock:
            if self._closed and not force:
                self._after_close += 1
                return
            channel_id, position = self._registry.next(stream_id, channel)
            frame = Frame(
                seq=self._seq,
                arrival_unix_ms=now_ms,
                source=source,
                stream=stream_id,
                channel=channel,
                channel_id=channel_id,
                position=position,
                payload=payload,
            )
            self._seq += 1
            for sink in self._sinks:
                sink.offer(frame, force=force)

    def forward(self, line: dict[str, Any]) -> bool:
        """Pass on a frame of another datastream (a frame line, as a subscriber or an
        archive has it) keeping its identity: source, stream, channel, channel id,
        position, arrival time and payload (process spec 9.18); only the publish
        sequence (``arrival_seq``) is this datastream's. The payload is redacted again
        with this datastream's secrets. False for a line that is no frame."""
        try:
            payload = line["payload"]
            raw = (
                str(payload["value"]).encode("utf-8")
                if payload["encoding"] == "utf8"
                else bytes(payload["value"])
            )
            frame_args = (
                int(line["arrival_unix_ms"]),
                str(line["source"]),
                str(line["stream"]),
                str(line["channel"]),
                int(line["channel_id"]),
                int(line["position"]),
            )
        except (KeyError, TypeError, ValueError):
            return False
        raw = self.redactor.redact_bytes(raw)
        with self._lock:
            if self._closed:
                self._after_close += 1
                return False
            frame = Frame(self._seq, *frame_args, payload=raw)
            self._seq += 1
            for sink in self._sinks:
                sink.offer(frame)
        return True

    def bootstrap(
        self,
        phase: BootstrapPhase,
        status: BootstrapStatus | str,
        detail: Any = None,
        *,
        node_id: int | None = None,
    ) -> None:
        self.publish(
            CHANNEL_BOOTSTRAP,
            orch_bootstrap(phase, status, self.run_id, self._node(node_id), detail),
        )

    def prompt_event(
        self,
        phase: str,
        status: str,
        request_id: int | None,
        detail: Any = None,
        *,
        node_id: int | None = None,
    ) -> None:
        self.publish(
            CHANNEL_PROMPT,
            orch_prompt_event(phase, status, self.run_id, self._node(node_id), request_id, detail),
        )

    def provision_event(
        self, node_id: int, kind: ProvisionEventKind | str, provider: str, message: str = ""
    ) -> None:
        self.publish(
            CHANNEL_PROVISIONING_EVENTS,
            provision_event(self.run_id, node_id, kind, provider, message),
        )

    def node_log(
        self,
        node_id: int,
        stream: LogStream | str,
        line: str,
        *,
        source: str = SOURCE_ORCHESTRATOR,
        stream_id: str | None = None,
    ) -> None:
        """A node's log line on ``mvp.provisioning.logs.node.<id>.<stream>``."""
        self.publish(
            node_log_channel(node_id, stream),
            log_line(self.run_id, node_id, stream, line),
            source=source,
            stream=stream_id,
        )

    def stdio_line(self, stream: LogStream | str, line: str) -> None:
        """A captured line of the host's own stdout/stderr (``mvp.orch.stdio.*``)."""
        self.publish(stdio_channel(stream), log_line(self.run_id, self.node_id, stream, line))

    def lifecycle(self, report: LifecycleReport, index: int | None = None) -> None:
        self.publish(CHANNEL_LIFECYCLE, lifecycle_record(report, index))

    def stage_route(
        self,
        node_id: int,
        stage_index: int | None,
        route: str,
        identity: str,
        owned: bool,
        pollers: Iterable[str] = (),
        detail: str = "",
    ) -> None:
        self.publish(
            CHANNEL_STAGE_ROUTE,
            stage_route_record(
                self.run_id, node_id, stage_index, route, identity, owned, pollers, detail
            ),
        )

    def membership(self, node_id: int, state: MembershipState | str, detail: Any = None) -> None:
        self.publish(CHANNEL_MEMBERSHIP, membership_record(self.run_id, node_id, state, detail))

    def _node(self, node_id: int | None) -> int:
        return self.node_id if node_id is None else int(node_id)

    # -- health

    @property
    def published(self) -> int:
        with self._lock:
            return self._seq

    @property
    def published_after_close(self) -> int:
        with self._lock:
            return self._after_close

    @property
    def drops(self) -> dict[str, int]:
        """Frames lost so far, per sink name."""
        return {s.name: s.dropped for s in self._sinks}

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return tuple(self._sinks)

    def channels(self, stream: str | None = None) -> dict[str, int]:
        """Channel name -> channel id of a stream (the orchestrator's by default)."""
        with self._lock:
            return self._registry.channels(stream or self.stream)

    def _maybe_summary(self, *, final: bool) -> None:
        with self._lock:
            if self._summary_interval_s is not None:
                self._next_summary = time.monotonic() + self._summary_interval_s
            published = self._seq
        with self._summary_lock:
            drops = self.drops
            if drops == self._reported_drops and not final:
                return
            self._reported_drops = drops
        self._publish(
            CHANNEL_BOOTSTRAP,
            drops_record(self.run_id, self.node_id, published, drops, final),
            source=SOURCE_ORCHESTRATOR,
            stream=None,
            force=True,
        )

    # -- closing

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Publish the final summary (published count, drops per sink), then flush and close
        every sink, all within ``timeout_s``. Later publishes are ignored (counted)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._maybe_summary(final=True)
        deadline = time.monotonic() + max(0.0, timeout_s)
        for sink in self._sinks:
            sink.close(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Datastream:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- log tailer


class LogTailer:
    """Follows a node's log file from offset 0 and publishes each complete line as a log
    record on ``mvp.provisioning.logs.node.<node_id>.<stream>`` (source ``node_log``,
    stream ``mvp-node-<run_id>-<node_id>``).

    A missing file is waited for; a file that shrinks or is replaced is read again from
    its start. Each poll reads at most ``max_bytes_per_poll``; a line longer than
    ``max_line_bytes`` is cut into pieces of that size. On ``stop`` the tailer reads what
    is left (bounded), and a last line without its newline is published too."""

    def __init__(
        self,
        datastream: Datastream,
        path: str | os.PathLike[str],
        *,
        node_id: int,
        stream: LogStream | str = LogStream.STDOUT,
        poll_interval_s: float = 0.2,
        max_bytes_per_poll: int = 256 * 1024,
        max_line_bytes: int = 64 * 1024,
        stop_drain_polls: int = 64,
        start_offset: int = 0,
    ) -> None:
        self._ds = datastream
        self.path = Path(path)
        self.node_id = int(node_id)
        self.log_stream = LogStream(stream)
        self._channel = node_log_channel(self.node_id, self.log_stream)
        self._stream_id = node_stream_id(datastream.run_id, self.node_id)
        self._poll_interval_s = poll_interval_s
        self._max_bytes = max_bytes_per_poll
        self._max_line = max_line_bytes
        self._stop_drain_polls = stop_drain_polls
        self._file: Any = None
        self._ino: tuple[int, int] | None = None
        self._offset = 0
        # Where a tailer of an earlier attempt stopped: the first open of the file
        # resumes there (unless the file is shorter now, then from its start).
        self._resume_at = max(0, int(start_offset))
        self._partial = bytearray()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_lock = threading.Lock()
        self._finished = False
        self.lines_published = 0

    @property
    def offset(self) -> int:
        """Bytes of the file published so far (complete lines only): where a later tailer
        of the same file resumes (``start_offset``)."""
        with self._poll_lock:
            return max(self._offset - len(self._partial), self._resume_at)

    def start(self) -> LogTailer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"log-tailer-{self.node_id}", daemon=True
            )
            self._thread.start()
        return self

    def poll(self) -> int:
        """One bounded read: publish the complete lines found; returns how many."""
        with self._poll_lock:
            if self._finished:
                return 0
            return self._poll_once()[0]

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop following: drain what is there, publish a last unterminated line, close."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(max(0.0, timeout_s))
            if self._thread.is_alive():
                return
        self._finish()

    def __enter__(self) -> LogTailer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._poll_lock:
                    read = self._poll_once()[1] if not self._finished else 0
            except Exception:
                read = 0
            if read < self._max_bytes:  # caught up: wait; else go on reading at once
                self._stop.wait(self._poll_interval_s)
        self._finish()

    def _finish(self) -> None:
        with self._poll_lock:
            if self._finished:
                return
            self._finished = True
            try:
                for _ in range(self._stop_drain_polls):
                    if self._poll_once()[1] == 0:
                        break
            except Exception:
                pass
            if self._partial:
                self._emit(bytes(self._partial))
                self._partial.clear()
            self._close_file()

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        self._file, self._ino = None, None

    def _open(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return self._file is not None  # gone: keep reading what we hold open
        ino = (st.st_dev, st.st_ino)
        if self._file is not None and ino == self._ino:
            if st.st_size < self._offset:  # truncated: read it again from the start
                self._offset = 0
                self._partial.clear()
            return True
        if self._file is not None:  # replaced: the old file's unterminated line ends here
            if self._partial:
                self._emit(bytes(self._partial))
            self._close_file()
        try:
            self._file = open(self.path, "rb")  # kept open between polls
        except OSError:
            return False
        self._ino, self._offset = ino, 0
        if self._resume_at and st.st_size >= self._resume_at:
            self._offset = self._resume_at
        self._resume_at = 0
        self._partial.clear()
        return True

    def _poll_once(self) -> tuple[int, int]:
        """(lines published, bytes read)."""
        if not self._open():
            return 0, 0
        try:
            self._file.seek(self._offset)
            data: bytes = self._file.read(self._max_bytes)
        except OSError:
            return 0, 0
        if not data:
            return 0, 0
        self._offset += len(data)
        buf = self._partial
        buf += data
        count = 0
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            while nl - start > self._max_line:
                self._emit(bytes(buf[start : start + self._max_line]))
                start += self._max_line
                count += 1
            self._emit(bytes(buf[start:nl]))
            count += 1
            start = nl + 1
        while len(buf) - start > self._max_line:
            self._emit(bytes(buf[start : start + self._max_line]))
            start += self._max_line
            count += 1
        del buf[:start]
        return count, len(data)

    def _emit(self, raw: bytes) -> None:
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        self._ds.node_log(
            self.node_id,
            self.log_stream,
            raw.decode("utf-8", "replace"),
            source=SOURCE_NODE_LOG,
            stream_id=self._stream_id,
        )
        self.lines_published += 1


# --------------------------------------------------------------------------- helpers


def read_frame_lines(text: str | TextIO) -> list[dict[str, Any]]:
    """Parse frame lines (an archive's text, or an open file): for tools and tests."""
    lines = text.splitlines() if isinstance(text, str) else text.read().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
