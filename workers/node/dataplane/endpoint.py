"""What both ends of an edge share: the socket, the spec, the peer, and the rule that a
fatal error on one edge closes it and its whole group (DECISIONS 20)."""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable
from typing import TypeVar

from .errors import EdgeClosed, EdgeError
from .records import EdgeSpec, RecordError
from .sockets import Closing, hard_close

__all__ = ["EdgeEnd", "log"]

log = logging.getLogger("mvp.dataplane")

_Fatal = TypeVar("_Fatal", EdgeError, RecordError)


class EdgeEnd(Closing):
    """Common state of both ends: the socket, the spec, the peer, the group's failure hook."""

    def __init__(self, sock: socket.socket, spec: EdgeSpec, peer: str) -> None:
        self._sock = sock
        self.spec = spec
        self.peer = peer
        self._closed = False
        self._broken: BaseException | None = None
        # The group this edge belongs to, told of its failure (group.py sets it).
        self._on_failure: Callable[[BaseException], None] | None = None
        self._timeout: float | None = None
        # Bytes this end sent or received (records and their headers, not the hello),
        # written by the edge's one thread, read by the node's datastream (DECISIONS 93).
        self.bytes = 0

    @property
    def direction(self) -> str:
        """``"out"`` for the sending end, ``"in"`` for the receiving one."""
        return "in"

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
        if self._close_quiet() and self._on_failure is not None:
            self._on_failure(EdgeClosed(f"edge {self.edge_id}: closed locally"))

    def _close_quiet(self) -> bool:
        if self._closed:
            return False
        self._closed = True
        hard_close(self._sock)
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
        if self._on_failure is not None:
            self._on_failure(exc)

    def _broken_by(self, exc: _Fatal, level: int = logging.ERROR) -> _Fatal:
        """``_failed(exc)``, and ``exc`` back for the caller to raise."""
        self._failed(exc, level)
        return exc

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
