"""Live subscribers: a loopback or unix-socket server that sends every attached
subscriber the frames from its attach on, each with its own bound, none slowing the
others or the run."""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import stat
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mvp_core.datastream import Frame, encode_frame_line
from mvp_io.datastream.address import format_address, parse_address
from mvp_io.datastream.sinks import DEFAULT_QUEUE_FRAMES, Sink

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


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
