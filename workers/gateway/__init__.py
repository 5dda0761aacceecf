"""``mvp-gateway``: an OpenAI-compatible HTTP gateway over one run (docs/gateway.md).

``workers.gateway.app.create_app(client, run_id)`` is the Starlette app;
``workers.gateway.main`` is the command."""
