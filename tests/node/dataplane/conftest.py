"""Shared fixtures: every data-plane test must leave no thread or socket behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.leaks import nothing_left_behind
from workers.node.dataplane import DataPlaneServer

TOKEN = "run-7-edge-token-0123456789abcdef"


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    with nothing_left_behind(timeout=2.0):
        yield


@pytest.fixture
def server() -> Iterator[DataPlaneServer]:
    srv = DataPlaneServer("127.0.0.1", 0, handshake_timeout_s=2.0)
    try:
        yield srv
    finally:
        srv.close()
