"""uvicorn inside a process that owns its signals (the gateway, the host)."""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import uvicorn


class SignallessServer(uvicorn.Server):
    """uvicorn without its own signal handling: its process stops it (``should_exit``)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield
