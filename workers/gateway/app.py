"""The gateway's Starlette app: OpenAI's HTTP API over the prompt API of one run or
several (DECISIONS 90).

``create_app(client, run_id)`` serves run ``mvp-run-<run_id>``, ``create_app(client,
[RunSpec(7), RunSpec(8, "alias")])`` several; it only builds the app: the runs served
(``runs.py``: each run's model, which run a request goes to, each run's end), the
service of one run (``service.py``: admission, streaming, stops, cancellation), the
routes of the API (``routes.py``), of re-attach (``attach.py``), of the admin API
(``admin.py``) and of the dashboard (``dashboard.py``, the first run's).

The run decides admission (a full queue is a 429, a run that is not prompt-ready a 503)
and generation; the head node encodes the prompt (rendering a conversation with the
model's chat template), counts its tokens and refuses, typed, a prompt that does not fit
(``Fault.kind``). The gateway adds what OpenAI has and the run has not: stop strings
(held back, cut, the prompt cancelled at once) and a client that goes away (its prompt
cancelled at once). It never loads the model's tokenizer (nor the engine, nor torch).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from starlette.applications import Starlette
from temporalio.client import Client

from temporal import telemetry
from workers.gateway.admin import admin_routes
from workers.gateway.attach import attach_routes
from workers.gateway.auth import ApiKeyMiddleware, ApiKeys
from workers.gateway.dashboard import dashboard_routes
from workers.gateway.routes import EXCEPTION_HANDLERS, api_routes
from workers.gateway.runs import RunSet, RunSpec


def create_app(
    client: Client,
    run_id: int | Sequence[RunSpec],
    *,
    poll_cooldown_ms: int = 20,
    api_keys: Sequence[str] = (),
    notify: Callable[[str], None] | None = None,
) -> Starlette:
    """The gateway of run ``mvp-run-<run_id>`` (or of each run of a sequence), on an open
    Temporal client; with ``api_keys``, only requests that carry one of them reach the
    API, the admin API and the dashboard. ``notify`` hears of runs added and ended."""
    specs = [RunSpec(run_id)] if isinstance(run_id, int) else list(run_id)
    if not specs:
        raise ValueError("a gateway serves at least one run to begin with")
    runs = RunSet(client, poll_cooldown_ms=poll_cooldown_ms, notify=notify)
    for spec in specs:
        runs.add(spec)
    primary = runs.primary
    assert primary is not None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runs.start()
        try:
            yield
        finally:
            await runs.aclose()

    app = Starlette(
        routes=[
            *api_routes(),
            *attach_routes(runs),
            *admin_routes(runs),
            *dashboard_routes(primary),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.runs = runs
    app.state.gateway = primary  # the first run's service (the dashboard's run)
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=ApiKeys(api_keys))
    if telemetry.current().tracing:  # off: no middleware at all
        app.add_middleware(telemetry.TracingMiddleware)
    return app
