"""TCP pipeline edges: authenticated, deadline-bounded, one direction per connection.

Blocking sockets in dedicated threads (the lowest-latency option next to a torch engine
that holds the GIL only in short stretches), TCP_NODELAY on both ends. The downstream end
listens (`DataPlaneServer`, from boot: DECISIONS 6); the upstream end connects
(`connect_edge`) and sends a hello carrying the edge id and the run's edge token; after
that, records flow upstream -> downstream only. Any error on any edge of a stage closes
all of that stage's edges (`EdgeGroup`) so the driver sees EOF within milliseconds
(DECISIONS 20).

Hello (connecting side): magic `MOH1`, edge_id u32 LE, token length u16 LE, token bytes.
Answer (accepting side): status u8 (0 ok, 1 edge not expected yet: retry, 2 rejected),
reason length u16 LE, reason UTF-8. On a non-zero status the accepting side closes. A
hello for an edge not expected yet is held up to `hold_unexpected_s` before the retry
answer, so an upstream that connects early is accepted as soon as the edge is expected.
A node that expects no edge yet (its stage still loading) refuses such hellos quietly:
that is the start-up order of a pipeline. Once it expects edges, a hello for another
edge is logged as a warning.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Self, TypeAlias

from mvp_core.edge_auth import (
    ANSWER,
    ANSWER_OK,
    ANSWER_REJECT,
    ANSWER_RETRY,
    HELLO,
    HELLO_MAGIC,
    MAX_TOKEN_LEN,
    TEXT_STREAM_EDGE_ID,
)

from .records import (
    HEADER_LEN,
    EdgeSpec,
    RecordError,
    RecordHeader,
    RecordOrder,
    decode_header,
    encode_header,
)

__all__ = [
    "HELLO_MAGIC",
    "DataPlaneServer",
    "Edge",
    "EdgeAuthError",
    "EdgeClosed",
    "EdgeError",
    "EdgeGroup",
    "EdgeReceiver",
    "EdgeSender",
    "EdgeTimeout",
    "connect_edge",
]

log = logging.getLogger("mvp.dataplane")

# The handshake (mvp_core.edge_auth, shared with the clients of the text stream).
_HELLO = HELLO
_ANSWER = ANSWER
_OK, _RETRY, _REJECT = ANSWER_OK, ANSWER_RETRY, ANSWER_REJECT
_RECV_BUF = 64 * 1024
# Once a record's first bytes have come, the rest may take this long (its sender was
# descheduled mid-send on a busy host, a large record crosses in many segments).
RECORD_REST_S = 5.0


class EdgeError(Exception):
    """Transport-level failure of an edge (a run fault per DECISIONS 14)."""


class EdgeTimeout(EdgeError, TimeoutError):
    """A read (or connect/send) missed its deadline.

    `partial` is False when nothing of the next record had arrived: the edge is still in
    sync and the caller may wait again (e.g. an idle stage between prompts). When True the
    edge has been closed (the stream cannot be resynchronised).
    """

    def __init__(self, message: str, *, partial: bool = False) -> None:
        super().__init__(message)
        self.partial = partial


class EdgeClosed(EdgeError):
    """The peer closed/reset the connection, or this end was closed locally."""


class EdgeAuthError(EdgeError):
    """The accepting side refused the hello (wrong token, duplicate edge, bad hello)."""


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "<unknown peer>"
    return f"{host}:{port}"


def _tune(sock: socket.socket) -> None:
    """NODELAY for per-token latency; keepalive so a vanished host is noticed eventually."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        opt = getattr(socket, name, None)
        if opt is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)


def _hard_close(sock: socket.socket) -> None:
    """shutdown() first: it wakes a thread blocked on the socket and sends FIN at once."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Handshake helper (not the hot path)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("handshake deadline")
        sock.settimeout(remaining)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


class _EdgeBase:
    """Common state of both ends: the socket, the spec, the peer, the group hook."""

    def __init__(self, sock: socket.socket, spec: EdgeSpec, peer: str) -> None:
        self._sock = sock
        self.spec = spec
        self.peer = peer
        self._closed = False
        self._broken: BaseException | None = None
        self._group: EdgeGroup | None = None
        self._timeout: float | None = None

    @property
    def edge_id(self) -> int:
        return self.spec.edge_id

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        """Idempotent; safe from any thread (wakes a thread blocked on this edge).

        Closing one edge of a live group takes the whole stage down, like an error would.
        """
        if self._close_quiet() and self._group is not None:
            self._group._member_failed(EdgeClosed(f"edge {self.edge_id}: closed locally"))

    def _close_quiet(self) -> bool:
        if self._closed:
            return False
        self._closed = True
        _hard_close(self._sock)
        return True

    def _set_timeout(self, remaining: float) -> None:
        # settimeout costs fcntl syscalls; a few ms of slack on a deadline is harmless.
        if self._timeout is None or abs(self._timeout - remaining) > 0.005:
            self._sock.settimeout(remaining)
            self._timeout = remaining

    def _failed(self, exc: EdgeError | RecordError, level: int = logging.ERROR) -> None:
        """Record a fatal error: log it, close this edge and the whole group."""
        if self._broken is None and not self._closed:
            log.log(level, "%s", exc)
        if self._broken is None:
            self._broken = exc
        self._close_quiet()
        if self._group is not None:
            self._group._member_failed(exc)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise EdgeClosed(f"edge {self.edge_id}: unusable after earlier error: {self._broken}")
        if self._closed:
            raise EdgeClosed(f"edge {self.edge_id}: closed locally")

    def _os_error(self, exc: OSError, doing: str) -> EdgeError:
        if self._closed:
            return EdgeClosed(f"edge {self.edge_id}: closed locally")
        return EdgeClosed(
            f"edge {self.edge_id}: connection to {self.peer} failed while {doing}: "
            f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror or exc}"
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EdgeSender(_EdgeBase):
    """The upstream end: sends records; never reads after the handshake."""

    def __init__(
        self, sock: socket.socket, spec: EdgeSpec, peer: str, send_timeout_s: float
    ) -> None:
        super().__init__(sock, spec, peer)
        self.send_timeout_s = send_timeout_s

    def send(
        self,
        object_id: int,
        sequence: int,
        payload: bytes | bytearray | memoryview = b"",
        flags: int = 0,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Send header + payload in one sendmsg (no concatenation copy).

        The record is validated against the spec first, so a bad record fails here with a
        RecordError instead of faulting the peer. Blocks at most `timeout_s` (default: the
        sender's send timeout) when the downstream does not drain.
        """
        self._check_usable()
        body = payload if isinstance(payload, memoryview) else memoryview(payload)
        if body.ndim != 1 or body.itemsize != 1:
            body = body.cast("B")
        header = encode_header(object_id, sequence, body.nbytes, flags, self.spec)
        deadline = time.monotonic() + (self.send_timeout_s if timeout_s is None else timeout_s)
        bufs: list[memoryview] = [memoryview(header), body] if body.nbytes else [memoryview(header)]
        try:
            while bufs:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                self._set_timeout(remaining)
                sent = self._sock.sendmsg(bufs)
                while sent and bufs:
                    if sent >= bufs[0].nbytes:
                        sent -= bufs[0].nbytes
                        bufs.pop(0)
                    else:
                        bufs[0] = bufs[0][sent:]
                        sent = 0
        except TimeoutError:
            exc: EdgeError = EdgeTimeout(
                f"edge {self.edge_id}: send to {self.peer} missed its deadline "
                f"({self.send_timeout_s if timeout_s is None else timeout_s} s)",
                partial=True,
            )
            self._failed(exc)
            raise exc from None
        except OSError as e:
            exc = self._os_error(e, "sending")
            self._failed(exc)
            raise exc from None

    def peer_closed(self) -> bool:
        """Non-blocking: has the downstream closed (or written, which it never should)?"""
        if self._closed:
            return True
        poller = select.poll()
        poller.register(self._sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))

    def _watch_event(self) -> None:
        """Called by the group watcher when the socket turned readable."""
        if self._closed:
            return
        exc = EdgeClosed(f"edge {self.edge_id}: downstream {self.peer} closed the connection")
        self._failed(exc, logging.WARNING)


class EdgeReceiver(_EdgeBase):
    """The downstream end: reads, validates and orders records."""

    def __init__(
        self, sock: socket.socket, spec: EdgeSpec, peer: str, *, check_order: bool = True
    ) -> None:
        super().__init__(sock, spec, peer)
        self._order = RecordOrder(spec.edge_id) if check_order else None
        self._buf = bytearray(_RECV_BUF)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def _fill(self, deadline: float, into: memoryview | None, partial: bool) -> int:
        """One recv_into with the remaining deadline; raises on timeout/EOF/reset."""
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            self._set_timeout(remaining)
            if into is None:
                if self._end == len(self._buf):  # compact
                    n = self._end - self._start
                    self._buf[:n] = self._view[self._start : self._end]
                    self._start, self._end = 0, n
                k = self._sock.recv_into(self._view[self._end :])
            else:
                k = self._sock.recv_into(into)
        except TimeoutError:
            if partial:
                exc: EdgeError = EdgeTimeout(
                    f"edge {self.edge_id}: read deadline missed in the middle of a record "
                    f"from {self.peer}",
                    partial=True,
                )
                self._failed(exc)
                raise exc from None
            raise EdgeTimeout(
                f"edge {self.edge_id}: no record from {self.peer} within the read deadline"
            ) from None
        except OSError as e:
            exc = self._os_error(e, "receiving")
            self._failed(exc)
            raise exc from None
        if k == 0:
            if self._closed:
                exc = EdgeClosed(f"edge {self.edge_id}: closed locally")
            elif partial:
                exc = EdgeClosed(
                    f"edge {self.edge_id}: peer {self.peer} closed the connection in the "
                    f"middle of a record"
                )
            else:
                exc = EdgeClosed(f"edge {self.edge_id}: peer {self.peer} closed the connection")
            self._failed(exc, logging.ERROR if partial else logging.WARNING)
            raise exc
        return k

    def ready(self) -> bool:
        """Whether bytes of a next record (or the peer's close) can be read without
        waiting: a stage takes every record that has come in as one batch."""
        if self._end > self._start:
            return True
        if self._closed or self._broken is not None:
            return True  # recv says why
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def recv(
        self, timeout_s: float, rest_s: float = RECORD_REST_S
    ) -> tuple[RecordHeader, bytearray]:
        """Next record: (validated header, payload). A record that has not begun within
        `timeout_s` seconds is a clean EdgeTimeout (the edge stays usable); once its first
        bytes are here, the rest has `rest_s` more seconds (at least), else the edge
        breaks (partial EdgeTimeout). An idle wait is often short (a loop that checks for
        its stop): a record that starts at its end must not break the edge.

        The payload is a fresh bytearray (numpy can view it without a copy). A RecordError
        (bad header, out-of-order sequence) is logged and closes the edge and its group.
        """
        self._check_usable()
        now = time.monotonic()
        deadline = now + timeout_s
        started = self._end > self._start  # bytes of this record came with the last one
        if started:
            deadline = max(deadline, now + rest_s)
        while self._end - self._start < HEADER_LEN:
            if self._start == self._end:
                self._start = self._end = 0
            self._end += self._fill(deadline, None, partial=started)
            if not started:
                started = True
                deadline = max(deadline, time.monotonic() + rest_s)
        try:
            header = decode_header(self._view[self._start : self._start + HEADER_LEN], self.spec)
            if self._order is not None:
                self._order.check(header)
        except RecordError as e:
            err = RecordError(f"{e} (from {self.peer}); closing the edge")
            self._failed(err)
            raise err from None
        self._start += HEADER_LEN
        extent = header.extent
        payload = bytearray(extent)
        have = min(self._end - self._start, extent)
        if have:
            payload[:have] = self._view[self._start : self._start + have]
            self._start += have
        if self._start == self._end:
            self._start = self._end = 0
        if have < extent:
            pview = memoryview(payload)
            while have < extent:
                have += self._fill(deadline, pview[have:], partial=True)
        return header, payload


Edge: TypeAlias = EdgeSender | EdgeReceiver


# --------------------------------------------------------------------------- connect


def connect_edge(
    host: str,
    port: int,
    spec: EdgeSpec,
    token: str | bytes,
    timeout: float,
    *,
    send_timeout_s: float = 30.0,
) -> EdgeSender:
    """Connect and authenticate the upstream end of `spec`, retrying until `timeout`.

    Retries while the downstream is not listening yet or has not been told about this edge
    yet; a wrong token or a duplicate edge fails at once with EdgeAuthError.
    """
    token_b = token.encode() if isinstance(token, str) else token
    if not 0 < len(token_b) <= MAX_TOKEN_LEN:
        raise ValueError(f"edge token must be 1..{MAX_TOKEN_LEN} bytes, got {len(token_b)}")
    hello = _HELLO.pack(HELLO_MAGIC, spec.edge_id, len(token_b)) + token_b
    deadline = time.monotonic() + timeout
    delay = 0.01
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EdgeTimeout(
                f"edge {spec.edge_id}: could not connect to {host}:{port} within "
                f"{timeout} s: {last}"
            )
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection((host, port), timeout=remaining)
            _tune(sock)
            sock.sendall(hello)
            status, reason_len = _ANSWER.unpack(_recv_exact(sock, _ANSWER.size, deadline))
            reason = _recv_exact(sock, reason_len, deadline).decode(errors="replace")
        except (OSError, EOFError) as e:
            if sock is not None:
                _hard_close(sock)
            # Timing out while the downstream holds the hello means the same as its last
            # answer (the edge is still not expected): keep that, it says more.
            if not (isinstance(e, TimeoutError) and last.startswith("rejected: ")):
                last = f"{type(e).__name__}: {e}"
        else:
            if status == _OK:
                sock.settimeout(None)
                return EdgeSender(sock, spec, f"{host}:{port}", send_timeout_s)
            _hard_close(sock)
            if status != _RETRY:
                raise EdgeAuthError(f"edge {spec.edge_id}: rejected by {host}:{port}: {reason}")
            last = f"rejected: {reason}"
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.25)


# --------------------------------------------------------------------------- server


class _Expectation:
    __slots__ = ("check_order", "future", "spec", "token")

    def __init__(self, spec: EdgeSpec, token: bytes, check_order: bool) -> None:
        self.spec = spec
        self.token = token
        self.check_order = check_order
        self.future: Future[EdgeReceiver] = Future()


class DataPlaneServer:
    """A node's data-plane listener: authenticates inbound edges and hands them out.

    Listens from construction (nodes advertise the port before they know their edges);
    connections for edges not `expect`ed yet are told to retry.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        handshake_timeout_s: float = 5.0,
        hold_unexpected_s: float = 0.5,
    ) -> None:
        self.handshake_timeout_s = handshake_timeout_s
        # A hello for an edge not expected yet (its stage is still loading) is held this
        # long for the expectation to appear, instead of being sent away to poll: the
        # upstream connects the moment the stage expects it.
        self.hold_unexpected_s = hold_unexpected_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an edge became expected, or closing
        self._expected: dict[int, _Expectation] = {}
        self._futures: dict[int, Future[EdgeReceiver]] = {}
        self._connected: set[int] = set()
        # Until its stage is provisioned a node expects nothing: an upstream that loaded
        # first knocks, is held, and retries (the start-up order, quiet); once it expects
        # edges, a hello for another one is a real misroute (a warning).
        self._expects_any = False
        self._tokens: dict[int, bytes] = {}  # kept after connection: later peers still authenticate
        self._receivers: list[EdgeReceiver] = []
        self._handshaking: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        # The head node's text stream (serve_text): its token and its handler.
        self._text: tuple[bytes, Callable[[socket.socket, str], None]] | None = None
        self._closing = False
        self._listener = socket.create_server((host, port), backlog=16)
        self._wake_r, self._wake_w = socket.socketpair()
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"dataplane-accept-{self.port}", daemon=True
        )
        self._accept_thread.start()

    # -- public API

    def expect(
        self, spec: EdgeSpec, token: str | bytes, *, check_order: bool = True
    ) -> Future[EdgeReceiver]:
        """Admit one connection for `spec.edge_id` carrying `token`."""
        token_b = token.encode() if isinstance(token, str) else token
        if not token_b:
            raise ValueError("edge token must not be empty")
        exp = _Expectation(spec, token_b, check_order)
        with self._lock:
            if self._closing:
                raise EdgeClosed("data-plane server is closed")
            if spec.edge_id in self._expected:
                raise ValueError(f"edge {spec.edge_id} is already expected")
            self._connected.discard(spec.edge_id)
            self._expected[spec.edge_id] = exp
            self._expects_any = True
            self._tokens[spec.edge_id] = token_b
            self._futures[spec.edge_id] = exp.future
            self._changed.notify_all()
        return exp.future

    def wait_inbound(self, edge_id: int, timeout: float) -> EdgeReceiver:
        with self._lock:
            fut = self._futures.get(edge_id)
        if fut is None:
            raise ValueError(f"edge {edge_id} was never expected")
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise EdgeTimeout(
                f"edge {edge_id}: no authenticated inbound connection within {timeout} s"
            ) from None

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._changed.notify_all()
            pending = list(self._expected.values())
            self._expected.clear()
            receivers = list(self._receivers)
            self._receivers.clear()
            handshaking = list(self._handshaking)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._accept_thread.join()
        for sock in handshaking:
            _hard_close(sock)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(self.handshake_timeout_s + 1)
        for exp in pending:
            if not exp.future.done():
                exp.future.set_exception(EdgeClosed(f"edge {exp.spec.edge_id}: server closed"))
        for r in receivers:
            r.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    def __enter__(self) -> DataPlaneServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._closing:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r or self._closing:
                        return
                    try:
                        sock, addr = self._listener.accept()
                    except OSError as e:
                        log.warning("data plane: accept failed: %s", e)
                        continue
                    t = threading.Thread(
                        target=self._handshake,
                        args=(sock, f"{addr[0]}:{addr[1]}"),
                        name=f"dataplane-hello-{addr[1]}",
                        daemon=True,
                    )
                    with self._lock:
                        if self._closing:
                            _hard_close(sock)
                            return
                        self._handshaking.add(sock)
                        self._threads.add(t)
                    t.start()
        finally:
            sel.close()

    def _answer(self, sock: socket.socket, status: int, reason: str) -> None:
        data = reason.encode()[:1000]
        with contextlib.suppress(OSError):
            sock.sendall(_ANSWER.pack(status, len(data)) + data)

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        handed = False
        try:
            handed = self._handshake_inner(sock, peer)
        except Exception:  # never let a handshake thread die silently
            log.exception("data plane: handshake with %s crashed", peer)
        finally:
            with self._lock:
                self._handshaking.discard(sock)
                self._threads.discard(threading.current_thread())
            if not handed:
                _hard_close(sock)

    def serve_text(self, token: str, handler: Callable[[socket.socket, str], None]) -> None:
        """Hand every connection that authenticates with ``token`` on the text-stream edge
        id (mvp_core.edge_auth) to ``handler(sock, peer)``, in its own thread; the socket
        is closed when the handler returns or the server closes."""
        if not token:
            raise ValueError("text-stream token must not be empty")
        with self._lock:
            self._text = (token.encode(), handler)

    def _text_stream(self, sock: socket.socket, peer: str, token: bytes) -> bool:
        with self._lock:
            served = self._text
        if served is None:
            log.warning("text stream: rejected connection from %s: this node serves none", peer)
            self._answer(sock, _REJECT, "this node serves no text stream")
            return False
        if not hmac.compare_digest(token, served[0]):
            log.warning("text stream: authentication failed: wrong token from %s", peer)
            self._answer(sock, _REJECT, "authentication failed: wrong text-stream token")
            return False
        try:
            sock.sendall(_ANSWER.pack(_OK, 0))
            sock.settimeout(None)
            served[1](sock, peer)
        except OSError as e:
            log.debug("text stream to %s ended: %s", peer, e)
        return False  # closed by the handshake's own clean-up

    def _read_hello(
        self, sock: socket.socket, peer: str, deadline: float
    ) -> tuple[int, bytes] | None:
        """The hello's edge id and token, or None (answered and logged: a bad magic or
        token length, an incomplete hello)."""
        try:
            _tune(sock)
            magic, edge_id, token_len = _HELLO.unpack(_recv_exact(sock, _HELLO.size, deadline))
            if magic != HELLO_MAGIC:
                log.warning(
                    "data plane: rejected connection from %s: bad hello magic %r (expected %r)",
                    peer,
                    magic,
                    HELLO_MAGIC,
                )
                self._answer(sock, _REJECT, f"bad hello magic {magic!r}")
                return None
            if not 0 < token_len <= MAX_TOKEN_LEN:
                log.warning(
                    "edge %d: rejected connection from %s: edge token length %d not in 1..%d",
                    edge_id,
                    peer,
                    token_len,
                    MAX_TOKEN_LEN,
                )
                self._answer(sock, _REJECT, f"edge token length {token_len} not allowed")
                return None
            token = _recv_exact(sock, token_len, deadline)
        except (OSError, EOFError) as e:
            if not self._closing:
                log.warning("data plane: incomplete hello from %s: %s", peer, e)
            return None
        return edge_id, token

    def _handshake_inner(self, sock: socket.socket, peer: str) -> bool:
        deadline = time.monotonic() + self.handshake_timeout_s
        hello = self._read_hello(sock, peer, deadline)
        if hello is None:
            return False
        edge_id, token = hello
        if edge_id == TEXT_STREAM_EDGE_ID:
            return self._text_stream(sock, peer, token)
        with self._lock:
            self._changed.wait_for(
                lambda: edge_id in self._expected or edge_id in self._connected or self._closing,
                timeout=max(0.0, min(self.hold_unexpected_s, deadline - time.monotonic())),
            )
            exp = self._expected.get(edge_id)
            expects_any = self._expects_any
            connected = edge_id in self._connected
            known = self._tokens.get(edge_id)
            if exp is not None and hmac.compare_digest(token, exp.token):
                del self._expected[edge_id]
                self._connected.add(edge_id)
                token_ok = True
            else:
                token_ok = False
        if (
            exp is None
            and connected
            and known is not None
            and not hmac.compare_digest(token, known)
        ):
            log.error("edge %d: authentication failed: wrong edge token from %s", edge_id, peer)
            self._answer(sock, _REJECT, "authentication failed: wrong edge token")
            return False
        if exp is None:
            if connected:
                log.warning(
                    "edge %d: rejected connection from %s: edge already connected",
                    edge_id,
                    peer,
                )
                self._answer(sock, _REJECT, f"edge {edge_id} already connected")
            elif expects_any:
                log.warning(
                    "edge %d: rejected connection from %s: edge not expected by this node",
                    edge_id,
                    peer,
                )
                self._answer(sock, _RETRY, f"edge {edge_id} not expected by this node")
            else:
                log.debug(
                    "edge %d: %s is early: this node expects no edge yet (its stage is "
                    "loading); it retries",
                    edge_id,
                    peer,
                )
                self._answer(sock, _RETRY, f"edge {edge_id} not expected by this node")
            return False
        if not token_ok:
            log.error("edge %d: authentication failed: wrong edge token from %s", edge_id, peer)
            self._answer(sock, _REJECT, "authentication failed: wrong edge token")
            return False

        try:
            sock.settimeout(self.handshake_timeout_s)
            sock.sendall(_ANSWER.pack(_OK, 0))
        except OSError as e:
            log.warning("edge %d: lost %s while accepting it: %s", edge_id, peer, e)
            with self._lock:
                self._connected.discard(edge_id)
                if not self._closing:
                    self._expected[edge_id] = exp
            return False
        sock.settimeout(None)
        receiver = EdgeReceiver(sock, exp.spec, peer, check_order=exp.check_order)
        with self._lock:
            closing = self._closing
            if not closing:
                self._receivers.append(receiver)
        if closing:
            if not exp.future.done():
                exp.future.set_exception(EdgeClosed(f"edge {edge_id}: server closed"))
            return False
        log.info("edge %d: accepted authenticated upstream %s", edge_id, peer)
        if not exp.future.set_running_or_notify_cancel():
            receiver.close()
            return True
        exp.future.set_result(receiver)
        return True


# --------------------------------------------------------------------------- group


class EdgeGroup:
    """All edges of one stage: the first error on any of them closes every one.

    Receivers and senders report their own fatal errors here. A watcher thread also
    notices a sender's downstream going away (its socket turns readable), so failure
    travels upstream too without waiting for the next send.
    """

    def __init__(self, name: str = "stage", *, watch_senders: bool = True) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._edges: list[EdgeSender | EdgeReceiver] = []
        self._first_error: BaseException | None = None
        self._failed = threading.Event()
        self._closed = False
        self._watch = watch_senders
        self._watch_pending: list[EdgeSender] = []
        self._watcher: threading.Thread | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None

    @property
    def first_error(self) -> BaseException | None:
        return self._first_error

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    def wait_failed(self, timeout: float | None = None) -> bool:
        return self._failed.wait(timeout)

    def raise_if_failed(self) -> None:
        if self._first_error is not None:
            raise EdgeError(f"{self.name}: data plane failed: {self._first_error}")

    def add(self, edge: EdgeSender | EdgeReceiver) -> None:
        with self._lock:
            if self._closed or self._failed.is_set():
                edge._close_quiet()
                raise EdgeClosed(f"{self.name}: edge group already closed")
            edge._group = self
            self._edges.append(edge)
            if isinstance(edge, EdgeSender) and self._watch:
                self._watch_pending.append(edge)
                if self._watcher is None:
                    self._wake_r, self._wake_w = socket.socketpair()
                    self._watcher = threading.Thread(
                        target=self._watch_loop, name=f"dataplane-watch-{self.name}", daemon=True
                    )
                    self._watcher.start()
                else:
                    self._wake()

    def fail(self, exc: BaseException) -> None:
        """Record `exc` (if first) and close every edge, e.g. on an engine crash."""
        self._member_failed(exc)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Any exception inside fails the group (then propagates)."""
        try:
            yield
        except BaseException as e:
            self._member_failed(e)
            raise

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            edges = list(self._edges)
            watcher = self._watcher
        self._wake()
        for e in edges:
            e._close_quiet()
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join()
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()

    def __enter__(self) -> EdgeGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals

    def _wake(self) -> None:
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")

    def _member_failed(self, exc: BaseException) -> None:
        with self._lock:
            if self._closed:
                return  # a deliberate close() already closes every edge
            if self._first_error is None:
                self._first_error = exc
                log.error("%s: closing all edges after: %s", self.name, exc)
            self._failed.set()
            edges = list(self._edges)
        self._wake()
        for e in edges:
            e._close_quiet()

    def _watch_loop(self) -> None:
        assert self._wake_r is not None
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                with self._lock:
                    if self._closed or self._failed.is_set():
                        return
                    pending, self._watch_pending = self._watch_pending, []
                for s in pending:
                    if not s.closed:
                        with contextlib.suppress(ValueError, KeyError, OSError):
                            sel.register(s._sock, selectors.EVENT_READ, s)
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                        continue
                    sender: EdgeSender = key.data
                    with contextlib.suppress(KeyError, ValueError, OSError):
                        sel.unregister(key.fileobj)
                    sender._watch_event()
        finally:
            sel.close()
