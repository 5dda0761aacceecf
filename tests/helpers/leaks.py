"""A check that a block leaves no thread running and no file descriptor open: what the
data plane's tests wrap every test in (sockets and their threads must go away)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from tests.helpers.waits import wait_until

__all__ = ["nothing_left_behind"]


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def nothing_left_behind(*, timeout: float) -> Iterator[None]:
    """Fail unless, within ``timeout`` s of the block's end, every thread it started has
    ended and every file descriptor it opened is closed (naming what is left)."""
    threads_before = set(threading.enumerate())
    fds_before = _fds()
    yield

    def left() -> tuple[list[threading.Thread], dict[str, str]]:
        """The threads, and the file descriptors with what they are, not there before."""
        threads = [t for t in threading.enumerate() if t not in threads_before]
        fds: dict[str, str] = {}
        for fd in _fds() - fds_before:
            with contextlib.suppress(OSError):  # gone meanwhile (the listing's own)
                fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        return threads, fds

    wait_until(
        lambda: left() == ([], {}),
        timeout=timeout,
        what="no thread or file descriptor left behind",
        interval=0.01,
        detail=lambda: "threads left running, file descriptors left open: {}, {}".format(*left()),
    )
