"""The downstream end of an edge: reads, validates and orders records, with a read
deadline that an idle wait may miss cleanly and a record begun may not."""

from __future__ import annotations

import logging
import socket
import time

from .endpoint import EdgeEnd
from .errors import EdgeClosed, EdgeTimeout
from .records import HEADER_LEN, EdgeSpec, RecordError, RecordHeader, RecordOrder, decode_header
from .sockets import readable_now

__all__ = ["RECORD_REST_S", "EdgeReceiver"]

_RECV_BUF = 64 * 1024
# Once a record's first bytes have come, the rest may take this long (its sender was
# descheduled mid-send on a busy host, a large record crosses in many segments).
RECORD_REST_S = 5.0


class EdgeReceiver(EdgeEnd):
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
        """One recv_into with the remaining deadline; raises on timeout/EOF/reset.

        ``into`` None: into the buffer, which it compacts first where it is full to its
        end; it moves the buffer's bounds itself, the end past the bytes read too (a
        caller that added the count to an ``_end`` read before the call undid a
        compaction: stale bytes were then read as the next records)."""
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
                raise self._broken_by(
                    EdgeTimeout(
                        f"edge {self.edge_id}: read deadline missed in the middle of a record "
                        f"from {self.peer}",
                        partial=True,
                    )
                ) from None
            raise EdgeTimeout(
                f"edge {self.edge_id}: no record from {self.peer} within the read deadline"
            ) from None
        except OSError as e:
            raise self._broken_by(self._os_error(e, "receiving")) from None
        self.bytes += k
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
            raise self._broken_by(exc, logging.ERROR if partial else logging.WARNING)
        if into is None:
            self._end += k
        return k

    def ready(self) -> bool:
        """Whether bytes of a next record (or the peer's close) can be read without
        waiting: a stage takes every record that has come in as one batch."""
        if self._end > self._start:
            return True
        if self._closed or self._broken is not None:
            return True  # recv says why
        try:
            return readable_now(self._sock)
        except (OSError, ValueError):
            return True

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
            self._fill(deadline, None, partial=started)
            if not started:
                started = True
                deadline = max(deadline, time.monotonic() + rest_s)
        try:
            header = decode_header(self._view[self._start : self._start + HEADER_LEN], self.spec)
            if self._order is not None:
                self._order.check(header)
        except RecordError as e:
            raise self._broken_by(
                RecordError(f"{e} (from {self.peer}); closing the edge")
            ) from None
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
