"""The sink a datastream offers its frames to: a bounded queue drained by the sink's own
thread, so that a slow consumer loses frames (counted) and never slows the run."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque

from mvp_core.datastream import Frame

DEFAULT_QUEUE_FRAMES = 10_000
DEFAULT_CLOSE_TIMEOUT_S = 5.0


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
