"""``mvp-orchestrator --dashboard [HOST:]PORT``: the live dashboard of the run this host
runs (docs/dashboard.md, DECISIONS 92): the gateway's page and event stream
(``workers.dashboard``), read with the host's Temporal client and fed by the run's
datastream, from the run's start until the host exits. Loopback only (the argument is
refused elsewhere: this page has no authentication); it only reads."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket

import uvicorn
from starlette.applications import Starlette
from temporalio.client import Client

from mvp_core.host_toml import SocketAddress
from workers.dashboard.hub import Dashboard, Hub
from workers.dashboard.observer import Observer
from workers.dashboard.sources import TemporalSource
from workers.web.server import SignallessServer

LAST_WORD_S = 1.0  # how long open pages get to receive the run's end before the server stops
SERVER_STOP_S = 5.0


class HostDashboard:
    """The dashboard's socket (bound before the run starts: a port in use starts
    nothing), then its server over the run."""

    def __init__(self, bind: SocketAddress) -> None:
        family = socket.AF_INET6 if ":" in bind.host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((bind.host, bind.port))
            self.sock.listen(64)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.hub: Hub | None = None
        self.server: SignallessServer | None = None
        self._serving: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        shown = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
        return f"http://{shown}:{port}/dashboard"

    def start(self, client: Client, run_id: int) -> None:
        """Serve the dashboard of run ``mvp-run-<run_id>`` (its only card: the host runs one)."""
        self.hub = Hub(Observer(TemporalSource(client), run_id, others=False))
        app = Starlette(routes=Dashboard(self.hub).routes())
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self.server = SignallessServer(config)
        self._serving = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))

    async def close(self) -> None:
        """The run's end to the open pages (one last read), then the server stops."""
        hub, server, serving = self.hub, self.server, self._serving
        if hub is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(LAST_WORD_S * 5):
                    await hub.finish()
            if hub.streams:
                await asyncio.sleep(LAST_WORD_S)
            hub.close()
        if server is not None and serving is not None:
            server.should_exit = True
            with contextlib.suppress(Exception):
                async with asyncio.timeout(SERVER_STOP_S):
                    await serving
            if hub is not None:
                await hub.aclose()
        self.sock.close()
