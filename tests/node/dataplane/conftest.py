"""Shared fixtures: every data-plane test must leave no thread or socket behind."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import pytest

from tests.helpers.waits import wait_until
from workers.node.dataplane import DataPlaneServer

TOKEN = "run-7-edge-token-0123456789abcdef"


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
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
        timeout=10,
        what="no thread or file descriptor left behind",
        interval=0.01,
        detail=lambda: "threads left running, file descriptors left open: {}, {}".format(*left()),
    )


@pytest.fixture
def server() -> Iterator[DataPlaneServer]:
    srv = DataPlaneServer("127.0.0.1", 0, handshake_timeout_s=2.0)
    try:
        yield srv
    finally:
        srv.close()
