"""Shared fixtures: every data-plane test must leave no thread or socket behind."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from workers.node.dataplane import DataPlaneServer

TOKEN = "run-7-edge-token-0123456789abcdef"


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    threads_before = set(threading.enumerate())
    fds_before = _fds()
    yield
    deadline = time.monotonic() + 2.0
    while True:
        extra_threads = [t for t in threading.enumerate() if t not in threads_before]
        extra_fds = _fds() - fds_before
        if (not extra_threads and not extra_fds) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not extra_threads, f"threads left running: {extra_threads}"
    leaked = {
        fd: os.readlink(f"/proc/self/fd/{fd}")
        for fd in extra_fds
        if os.path.exists(f"/proc/self/fd/{fd}")
    }
    assert not leaked, f"file descriptors left open: {leaked}"


@pytest.fixture
def server() -> Iterator[DataPlaneServer]:
    srv = DataPlaneServer("127.0.0.1", 0, handshake_timeout_s=2.0)
    try:
        yield srv
    finally:
        srv.close()
