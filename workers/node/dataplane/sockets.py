"""Socket helpers every edge module shares: tuning, a hard close, the handshake's exact
reads, a look for bytes without waiting, a self-pipe that wakes a selector loop, and
closing on leaving a ``with``."""

from __future__ import annotations

import contextlib
import select
import socket
import time
from typing import Self

__all__ = ["Closing", "Wakeup", "hard_close", "readable_now", "recv_exact", "tune"]


def tune(sock: socket.socket) -> None:
    """NODELAY for per-token latency; keepalive so a vanished host is noticed eventually."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        opt = getattr(socket, name, None)
        if opt is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)


def readable_now(sock: socket.socket) -> bool:
    """Whether ``sock`` has bytes, or its peer's close or an error, to read now. With
    poll, not select: select cannot watch a descriptor of 1024 or more (FD_SETSIZE), which
    a process holding many sockets hands out. Raises OSError or ValueError for a socket
    already closed here."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def hard_close(sock: socket.socket) -> None:
    """shutdown() first: it wakes a thread blocked on the socket and sends FIN at once."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
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


class Wakeup:
    """A socket pair: ``reader`` sits in a selector loop beside the sockets it watches,
    ``wake()`` makes it readable from any thread so the loop looks at its state again."""

    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self._writer.send(b"x")

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            self.reader.recv(64)

    def close(self) -> None:
        for s in (self.reader, self._writer):
            s.close()


class Closing:
    """``with`` closes it on the way out (whatever ``close`` means for the subclass)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
