"""All edges of one stage as one unit (`EdgeGroup`): any error on any edge of a stage
closes all of that stage's edges, so the driver sees EOF within milliseconds
(DECISIONS 20)."""

from __future__ import annotations

import contextlib
import logging
import selectors
import threading
from collections.abc import Iterator
from typing import TypeAlias

from .errors import EdgeClosed, EdgeError
from .receiver import EdgeReceiver
from .sender import EdgeSender
from .sockets import Closing, Wakeup

log = logging.getLogger("mvp.dataplane")

__all__ = ["Edge", "EdgeGroup"]

Edge: TypeAlias = EdgeSender | EdgeReceiver


class EdgeGroup(Closing):
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
        self._wakeup: Wakeup | None = None

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
            edge._on_failure = self._member_failed
            self._edges.append(edge)
            if isinstance(edge, EdgeSender) and self._watch:
                self._watch_pending.append(edge)
                if self._watcher is None:
                    self._wakeup = Wakeup()
                    self._watcher = threading.Thread(
                        target=self._watch_loop, name=f"dataplane-watch-{self.name}", daemon=True
                    )
                    self._watcher.start()
                else:
                    self._wake()

    def edges(self) -> list[EdgeSender | EdgeReceiver]:
        """The stage's edges so far (each with its ``bytes`` and ``direction``)."""
        with self._lock:
            return list(self._edges)

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
        if self._wakeup is not None:
            self._wakeup.close()

    # -- internals

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.wake()

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
        assert self._wakeup is not None
        wakeup = self._wakeup
        sel = selectors.DefaultSelector()
        sel.register(wakeup.reader, selectors.EVENT_READ)
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
                    if key.fileobj is wakeup.reader:
                        wakeup.drain()
                        continue
                    sender: EdgeSender = key.data
                    with contextlib.suppress(KeyError, ValueError, OSError):
                        sel.unregister(key.fileobj)
                    sender._watch_event()
        finally:
            sel.close()
