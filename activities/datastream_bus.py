"""An in-process bus from the provider activities to their run's datastream activity.

The provider activities of a host (start, stop, watch) and the run datastream activity
(``activities/datastream.py``) run in the same orchestrator worker, on the host's
provider queue. A provider step that people want to see (a Vast.ai rent, an offer
tried, an SSH/bootstrap step, a 429 wait, a failed start) is put here, keyed by the
run's id; the datastream activity of that run drains it into the run's datastream.

Bounded and observational: nobody waits on it. While no datastream activity of a run is
attached, its items are kept (at most ``MAX_ITEMS`` per run, the oldest dropped and
counted), so the first steps of a run, published before its datastream attaches, still
reach it. A run's queue is forgotten when its datastream detaches at the run's end.

Provider code does not need to know the bus: ``ProviderLogHandler`` turns the records of
the providers' loggers (``mvp.provider.*``, ``activities.providers.*``) into provider log
lines of the run and node the current activity works for (``run_context``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MAX_ITEMS = 2_000
MAX_RUNS = 256  # runs with items but no datastream attached (a rejected run's, say)


@dataclass(frozen=True)
class BusItem:
    """One thing for a run's datastream: a ``channel`` and its JSON ``record``."""

    channel: str
    record: Any


class _RunQueue:
    __slots__ = ("attached", "dropped", "items")

    def __init__(self) -> None:
        self.items: deque[BusItem] = deque()
        self.dropped = 0
        self.attached = 0


_lock = threading.Lock()
_runs: dict[int, _RunQueue] = {}


def publish(run_id: int, channel: str, record: Any) -> None:
    """Offer one record to run ``run_id``'s datastream; never blocks, never raises."""
    with _lock:
        q = _runs.get(run_id)
        if q is None:
            if len(_runs) >= MAX_RUNS:  # forget the oldest run nobody attached to
                for rid, other in list(_runs.items()):
                    if not other.attached:
                        del _runs[rid]
                        break
            q = _runs[run_id] = _RunQueue()
        if len(q.items) >= MAX_ITEMS:
            q.items.popleft()
            q.dropped += 1
        q.items.append(BusItem(channel, record))


def drain(run_id: int, limit: int = MAX_ITEMS) -> list[BusItem]:
    """Take (at most ``limit`` of) what run ``run_id``'s queue holds, oldest first."""
    with _lock:
        q = _runs.get(run_id)
        if q is None:
            return []
        out: list[BusItem] = []
        while q.items and len(out) < limit:
            out.append(q.items.popleft())
        return out


def dropped(run_id: int) -> int:
    with _lock:
        q = _runs.get(run_id)
        return 0 if q is None else q.dropped


@contextlib.contextmanager
def attached(run_id: int) -> Iterator[None]:
    """While a datastream activity of the run drains it; the last to leave forgets it."""
    with _lock:
        q = _runs.setdefault(run_id, _RunQueue())
        q.attached += 1
    try:
        yield
    finally:
        with _lock:
            q.attached -= 1
            if q.attached <= 0 and _runs.get(run_id) is q and not q.items:
                del _runs[run_id]


def forget(run_id: int) -> None:
    with _lock:
        _runs.pop(run_id, None)


# --------------------------------------------------------------------------- context

_context: contextvars.ContextVar[tuple[int, int, str] | None] = contextvars.ContextVar(
    "mvp_datastream_run", default=None
)


@contextlib.contextmanager
def run_context(run_id: int, node_id: int, provider: str) -> Iterator[None]:
    """Log records of the providers' loggers made inside (also in threads started with
    ``asyncio.to_thread``, which copies the context) become provider log lines of
    (``run_id``, ``node_id``)."""
    token = _context.set((int(run_id), int(node_id), str(provider)))
    try:
        yield
    finally:
        _context.reset(token)


def current() -> tuple[int, int, str] | None:
    """(run_id, node_id, provider) of the provider step running here, if any."""
    return _context.get()


class ProviderLogHandler(logging.Handler):
    """Publishes a provider logger's records (INFO and up) as provider log lines of the
    run and node in ``run_context``; records made outside any run context are skipped."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        ctx = _context.get()
        if ctx is None:
            return
        run_id, node_id, _provider = ctx
        try:
            text = record.getMessage()
        except Exception:
            return
        # Imported here: the core's record builders (pure) without a cycle at import.
        from mvp_core.datastream import LogStream, log_line, node_log_channel

        line = f"{record.levelname.lower()} {text}"
        publish(
            run_id,
            node_log_channel(node_id, LogStream.PROVIDER),
            log_line(run_id, node_id, LogStream.PROVIDER, line),
        )


PROVIDER_LOGGERS = ("mvp.provider", "activities.providers")
_installed = False


def install_provider_log_handler() -> None:
    """Once per process: the providers' loggers feed the bus (the orchestrator worker)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    handler = ProviderLogHandler()
    for name in PROVIDER_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
