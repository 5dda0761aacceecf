"""The gateway's live dashboard: ``GET /dashboard`` and ``GET /dashboard/events``
(docs/dashboard.md), the shared page and poller of ``workers.dashboard`` over the
gateway's run, read with the gateway's Temporal client and fed by the run's datastream.
It observes, never controls."""

from __future__ import annotations

from starlette.routing import Route

from workers.dashboard.hub import Dashboard, Hub
from workers.dashboard.observer import Observer
from workers.dashboard.sources import TemporalSource
from workers.gateway.service import Gateway


def dashboard_routes(gateway: Gateway) -> list[Route]:
    """The dashboard of the gateway's run, read from Temporal with the gateway's client;
    ``gateway.close_viewers()`` ends its streams."""
    hub = Hub(Observer(TemporalSource(gateway.client), gateway.run_id))
    gateway.viewers.append(hub.close)
    return Dashboard(hub).routes()
