"""A TCP delay line for benchmarks and tests: every byte, in each direction, arrives a
fixed one-way delay after the proxy read it (this host's kernel has no netem).

``DelayProxy(target_host, target_port, delay_s)`` listens on ``host:port`` (0: any free
port) and connects each accepted client to the target. Each direction of a connection is
a delay line, not a queue behind a sleep: a reader thread timestamps what it reads and
keeps reading while earlier chunks wait; a writer thread writes each chunk when it is
due (read time + delay), in order. So a round trip costs twice the delay, and a burst of
small messages arrives one delay later, spaced as it was sent, not one delay apiece.

- Bounded: at most ``max_buffer_bytes`` wait per direction; past that the reader stops
  reading, and the sender is held back by TCP as by a slow link. A delay line carries at
  most ``max_buffer_bytes / delay_s`` bytes per second.
- Close and half-close travel like data: an EOF read at t is a ``shutdown(SHUT_WR)`` on
  the other side at t + delay, after every byte before it; a connection reset read at t
  closes both sides at t + delay. A write that fails (its peer is gone) closes both sides
  at once. The connection's sockets are closed when both directions have ended.
- Not delayed: TCP's own connection setup (a client's connect returns as soon as the
  proxy accepts; the proxy connects to the target at once), so a connection costs two
  delays less than on a real link of that delay. Only bytes are delayed.

Each connection has four threads (a reader and a writer per direction); ``close()`` ends
every connection and joins every thread.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import deque
from typing import Final

__all__ = ["DelayProxy", "front_listener"]

log = logging.getLogger("mvp.dataplane.delay")

_CHUNK: Final = 64 * 1024
_COALESCE: Final = 256 * 1024  # due chunks written in one send, at most
_SPIN_S: Final = 0.0003  # how long before a chunk is due its writer stops sleeping
_EOF: Final = b""  # a queued EOF: shutdown(SHUT_WR) the destination when due
_RESET: Final = object()  # a queued reset: close the connection when due


def _nodelay(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Direction:
    """One way of one connection: ``src`` -> delay line -> ``dst``."""

    def __init__(self, conn: _Connection, src: socket.socket, dst: socket.socket) -> None:
        self.conn = conn
        self.src = src
        self.dst = dst
        lock = threading.Lock()
        self.not_empty = threading.Condition(lock)
        self.not_full = threading.Condition(lock)
        self.queue: deque[tuple[float, bytes | object]] = deque()
        self.buffered = 0

    def _push(self, due: float, item: bytes | object) -> None:
        with self.not_empty:
            self.queue.append((due, item))
            if isinstance(item, bytes):
                self.buffered += len(item)
            if len(self.queue) == 1:
                self.not_empty.notify()

    def read_loop(self) -> None:
        conn = self.conn
        limit = conn.proxy.max_buffer_bytes
        while True:
            with self.not_full:
                while self.buffered >= limit and not conn.aborted:
                    self.not_full.wait()
                room = limit - self.buffered
            if conn.aborted:
                return
            try:
                data = self.src.recv(min(_CHUNK, room))
            except OSError as err:
                if not conn.aborted:
                    log.debug("delay proxy: read failed: %s", err)
                    self._push(time.monotonic() + conn.proxy.delay_s, _RESET)
                return
            if conn.aborted:
                return
            self._push(time.monotonic() + conn.proxy.delay_s, data)
            if not data:
                return

    def _next(self) -> tuple[float, list[bytes | object]] | None:
        """Block until the head of the line is due; pop it (and whatever data is due with
        it, up to _COALESCE bytes) with its due time. None when the connection is aborted."""
        conn = self.conn
        with self.not_empty:
            while True:
                if conn.aborted:
                    return None
                if not self.queue:
                    self.not_empty.wait()
                    continue
                due = self.queue[0][0]
                wait = due - time.monotonic()
                if wait <= _SPIN_S:
                    break
                self.not_empty.wait(wait - _SPIN_S)
        # A timed wait wakes 0.1-0.2 ms late; the last stretch is slept in yields instead,
        # without the lock (only this thread pops, so the head stays the head).
        while time.monotonic() < due:
            time.sleep(0)
        with self.not_empty:
            if conn.aborted:
                return None
            now = time.monotonic()
            items: list[bytes | object] = []
            size = 0
            while self.queue and self.queue[0][0] <= now and size < _COALESCE:
                _, item = self.queue.popleft()
                items.append(item)
                if not isinstance(item, bytes) or not item:
                    break  # a marker ends the batch
                size += len(item)
            self.buffered -= size
            self.not_full.notify()
            return due, items

    def write_loop(self) -> None:
        conn = self.conn
        while True:
            batch = self._next()
            if batch is None:
                return
            due, items = batch
            data = [x for x in items if isinstance(x, bytes) and x]
            try:
                if data:
                    conn.proxy._written(time.monotonic() - due)
                    self.dst.sendall(data[0] if len(data) == 1 else b"".join(data))
            except OSError as err:
                if not conn.aborted:
                    log.debug("delay proxy: write failed: %s", err)
                conn.abort()
                return
            last = items[-1]
            if last is _RESET:
                conn.abort()
                return
            if last == _EOF:
                with contextlib.suppress(OSError):
                    self.dst.shutdown(socket.SHUT_WR)
                return


class _Connection:
    """A client, its connection to the target, and the two delay lines between them."""

    def __init__(self, proxy: DelayProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.aborted = False
        self._lock = threading.Lock()
        self._live = 0
        self.threads: list[threading.Thread] = []
        self._directions: tuple[_Direction, ...] = ()

    def start(self) -> None:
        self._spawn(self._main, "delay-connect")

    def _spawn(self, target: object, name: str) -> None:
        assert callable(target)

        def run() -> None:
            try:
                target()
            except Exception:  # never let a proxy thread die silently
                log.exception("delay proxy: %s crashed", name)
                self.abort()
            finally:
                self._exited()

        t = threading.Thread(target=run, name=f"{name}-{self.proxy.port}", daemon=True)
        with self._lock:
            self._live += 1
            self.threads.append(t)
        t.start()

    def _main(self) -> None:
        proxy = self.proxy
        _nodelay(self.client)
        try:
            upstream = socket.create_connection(proxy.target, timeout=proxy.connect_timeout_s)
        except OSError as err:
            log.warning("delay proxy: cannot reach %s:%d: %s", *proxy.target, err)
            self.abort()
            return
        upstream.settimeout(None)
        _nodelay(upstream)
        with self._lock:
            self.upstream = upstream
            aborted = self.aborted
        if aborted:
            self.abort()  # abort() ran before the upstream existed: shut it too
            return
        up = _Direction(self, self.client, upstream)
        down = _Direction(self, upstream, self.client)
        with self._lock:
            self._directions = (up, down)
        self._spawn(up.write_loop, "delay-up-write")
        self._spawn(down.read_loop, "delay-down-read")
        self._spawn(down.write_loop, "delay-down-write")
        up.read_loop()

    def abort(self) -> None:
        """End both directions now: wake every thread, shut both sockets."""
        with self._lock:
            self.aborted = True
            socks = [s for s in (self.client, self.upstream) if s is not None]
            directions = self._directions
        for d in directions:
            with d.not_empty:
                d.not_empty.notify_all()
                d.not_full.notify_all()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _exited(self) -> None:
        with self._lock:
            self._live -= 1
            last = self._live == 0
        if last:  # every thread of this connection is done with its sockets
            for s in (self.client, self.upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()
            self.proxy._forget(self)


class DelayProxy:
    """Listens on ``host:port`` and relays each connection to ``target_host:target_port``
    with ``delay_s`` added to every byte in each direction (see the module docstring)."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        delay_s: float,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_buffer_bytes: int = 4 * 1024 * 1024,
        connect_timeout_s: float = 5.0,
    ) -> None:
        if delay_s < 0:
            raise ValueError(f"delay must be >= 0, got {delay_s}")
        if max_buffer_bytes < 1:
            raise ValueError("max_buffer_bytes must be positive")
        self.target: tuple[str, int] = (target_host, target_port)
        self.delay_s = delay_s
        self.max_buffer_bytes = max_buffer_bytes
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self._closing = False
        self._writes = 0
        self._late_total = 0.0
        self._late_max = 0.0
        self._listener = socket.create_server((host, port), backlog=16)
        self._wake_r, self._wake_w = socket.socketpair()
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"delay-accept-{self.port}", daemon=True
        )
        self._accept_thread.start()

    @property
    def connections(self) -> int:
        """Connections whose threads have not all ended yet."""
        with self._lock:
            return len(self._connections)

    @property
    def buffered_bytes(self) -> int:
        """Bytes read and not yet written, over every connection and direction."""
        with self._lock:
            conns = list(self._connections)
        total = 0
        for c in conns:
            with c._lock:
                directions = c._directions
            for d in directions:
                with d.not_empty:
                    total += d.buffered
        return total

    def lateness(self) -> tuple[int, float, float]:
        """(writes, mean s, max s) by which writes started after they were due: how much
        this process added to the delay on top of ``delay_s`` (scheduling, the GIL)."""
        with self._lock:
            mean = self._late_total / self._writes if self._writes else 0.0
            return self._writes, mean, self._late_max

    def _written(self, late: float) -> None:
        with self._lock:
            self._writes += 1
            self._late_total += late
            self._late_max = max(self._late_max, late)

    def close(self) -> None:
        """Stop accepting, end every connection, and join every thread. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._accept_thread.join()
        while True:  # a connection still starting may spawn threads after an abort
            with self._lock:
                conns = list(self._connections)
            if not conns:
                break
            for c in conns:
                c.abort()
            for c in conns:
                with c._lock:
                    threads = list(c.threads)
                for t in threads:
                    t.join()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._connections.discard(conn)

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    try:
                        sock, _addr = self._listener.accept()
                    except OSError as err:
                        log.warning("delay proxy: accept failed: %s", err)
                        continue
                    conn = _Connection(self, sock)
                    with self._lock:
                        if self._closing:
                            sock.close()
                            return
                        self._connections.add(conn)
                    conn.start()
        finally:
            sel.close()


def front_listener(host: str, port: int, delay_s: float) -> DelayProxy:
    """A delay line in front of a listener at ``host:port`` (a node's data-plane server),
    reachable wherever the listener is: it listens on the same address, on its own port.
    The node advertises the proxy's port, so every edge a peer opens crosses one delay,
    while the node's own connections to its real port (the head's token-in) cross none."""
    target = "127.0.0.1" if host in ("", "0.0.0.0") else host
    return DelayProxy(target, port, delay_s, host=host)
