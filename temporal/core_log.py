"""The SDK core's own warnings, through Python logging and without bursts.

The Temporal SDK's Rust core writes its warnings straight to stderr. While the server is
away (a dev server stopped before its workers, a restart, a network cut) every poller
warns on every retry: dozens of 400-character lines a minute, in colour, in every
worker's and node's log. Here the core's warnings go to the ``temporalio.core`` logger
(the process's handlers and format, no escape codes), and a warning that repeats is
said once per REPEAT_WINDOW_S with the count of those held back, so a lost server is one
line, then one line a minute while it stays lost.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)

CORE_LOGGER = "temporalio.core"
REPEAT_WINDOW_S = 60.0
MAX_MESSAGE = 300

_DIGITS = re.compile(r"\d+")
_lock = threading.Lock()
_runtime: Runtime | None = None


class RepeatFilter(logging.Filter):
    """Lets a message through once per ``window_s``: the same message up to its numbers
    (a retry count, a port, a time) within the window is held back and counted, and the
    next one after it says how many were. Long messages (the core's gRPC status dumps)
    are cut to MAX_MESSAGE characters."""

    def __init__(
        self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.window_s = window_s
        self._clock = clock
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (last said at, held back)
        self._mu = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        key = _DIGITS.sub("#", message)[:160]
        now = self._clock()
        with self._mu:
            said_at, held = self._seen.get(key, (None, 0))
            if said_at is not None and now - said_at < self.window_s:
                self._seen[key] = (said_at, held + 1)
                return False
            self._seen[key] = (now, 0)
            if len(self._seen) > 256:  # bounded: forget the oldest
                oldest = min(self._seen, key=lambda k: self._seen[k][0])
                del self._seen[oldest]
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + "…"
        if held:
            message += f" ({held} more like it in the last {self.window_s:.0f} s held back)"
        record.msg, record.args = message, None
        return True


def logging_config() -> LoggingConfig:
    """The core's warnings (its other targets' errors) to ``temporalio.core``, once per
    repeat window (RepeatFilter on that logger)."""
    logger = logging.getLogger(CORE_LOGGER)
    if not any(isinstance(f, RepeatFilter) for f in logger.filters):
        logger.addFilter(RepeatFilter())
    return LoggingConfig(
        filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
        forwarding=LogForwardingConfig(
            logger=logger,
            # One logger (the filter is on it: a child's records skip a parent's filters),
            # the core's target at the start of the message instead.
            append_target_to_name=False,
            prepend_target_on_message=True,
        ),
    )


def runtime() -> Runtime:
    """This process's runtime when telemetry makes none of its own (one per process)."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = Runtime(telemetry=TelemetryConfig(logging=logging_config()))
        return _runtime
