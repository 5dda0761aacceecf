"""The upstream end of an edge: connect and authenticate (``connect_edge``), then send
records; it never reads after the handshake (DECISIONS 6)."""

from __future__ import annotations

import logging
import select
import socket
import time

from mvp_core.edge_auth import (
    ANSWER,
    ANSWER_OK,
    ANSWER_RETRY,
    HELLO,
    HELLO_MAGIC,
    MAX_TOKEN_LEN,
)

from .endpoint import EdgeEnd
from .errors import EdgeAuthError, EdgeClosed, EdgeTimeout
from .records import EdgeSpec, encode_header
from .sockets import hard_close, recv_exact, tune

__all__ = ["EdgeSender", "connect_edge"]


class EdgeSender(EdgeEnd):
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
        size = len(header) + body.nbytes
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
            self.bytes += size
        except TimeoutError:
            raise self._broken_by(
                EdgeTimeout(
                    f"edge {self.edge_id}: send to {self.peer} missed its deadline "
                    f"({self.send_timeout_s if timeout_s is None else timeout_s} s)",
                    partial=True,
                )
            ) from None
        except OSError as e:
            raise self._broken_by(self._os_error(e, "sending")) from None

    @property
    def direction(self) -> str:
        return "out"

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
    hello = HELLO.pack(HELLO_MAGIC, spec.edge_id, len(token_b)) + token_b
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
            tune(sock)
            sock.sendall(hello)
            status, reason_len = ANSWER.unpack(recv_exact(sock, ANSWER.size, deadline))
            reason = recv_exact(sock, reason_len, deadline).decode(errors="replace")
        except (OSError, EOFError) as e:
            if sock is not None:
                hard_close(sock)
            # Timing out while the downstream holds the hello means the same as its last
            # answer (the edge is still not expected): keep that, it says more.
            if not (isinstance(e, TimeoutError) and last.startswith("rejected: ")):
                last = f"{type(e).__name__}: {e}"
        else:
            if status == ANSWER_OK:
                sock.settimeout(None)
                return EdgeSender(sock, spec, f"{host}:{port}", send_timeout_s)
            hard_close(sock)
            if status != ANSWER_RETRY:
                raise EdgeAuthError(f"edge {spec.edge_id}: rejected by {host}:{port}: {reason}")
            last = f"rejected: {reason}"
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.25)
