"""``mvp-gateway``: an OpenAI-compatible HTTP gateway over one run or several
(docs/gateway.md).

``workers.gateway.app.create_app(client, run_id)`` is the Starlette app (a sequence of
``RunSpec`` for several runs); ``workers.gateway.main`` is the command."""
