"""The gateway's Starlette app: OpenAI's HTTP API over one run's prompt API.

``create_app(client, run_id)`` serves run ``mvp-run-<run_id>``; it only builds the app:
the service (``service.py``: admission, streaming, stops, cancellation), the routes of
the API (``routes.py``), of re-attach (``attach.py``) and of the dashboard
(``dashboard.py``).

The run decides admission (a full queue is a 429, a run that is not prompt-ready a 503)
and generation; the head node encodes the prompt (rendering a conversation with the
model's chat template), counts its tokens and refuses, typed, a prompt that does not fit
(``Fault.kind``). The gateway adds what OpenAI has and the run has not: stop strings
(held back, cut, the prompt cancelled at once) and a client that goes away (its prompt
cancelled at once). It never loads the model's tokenizer (nor the engine, nor torch).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from temporalio.client import Client

from temporal import telemetry
from workers.gateway.attach import attach_routes
from workers.gateway.auth import ApiKeyMiddleware, ApiKeys
from workers.gateway.dashboard import dashboard_routes
from workers.gateway.routes import EXCEPTION_HANDLERS, api_routes
from workers.gateway.service import Gateway


def create_app(
    client: Client, run_id: int, *, poll_cooldown_ms: int = 20, api_keys: Sequence[str] = ()
) -> Starlette:
    """The gateway of run ``mvp-run-<run_id>``, on an open Temporal client; with
    ``api_keys``, only requests that carry one of them reach the API and the dashboard."""
    gateway = Gateway(client, run_id, poll_cooldown_ms=poll_cooldown_ms)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gateway.start()
        try:
            yield
        finally:
            await gateway.aclose()

    app = Starlette(
        routes=[*api_routes(), *attach_routes(gateway), *dashboard_routes(gateway)],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=ApiKeys(api_keys))
    if telemetry.current().tracing:  # off: no middleware at all
        app.add_middleware(telemetry.TracingMiddleware)
    return app
