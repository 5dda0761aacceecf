"""The live dashboard that the gateway and the process host both serve (docs/dashboard.md):
the page, its event stream and poller (``hub``), what it reads of Temporal (``sources``)
and of the served run's datastream (``feed``, ``facts``), and the shaping (``view``).

Shared, not a room: it imports no room, and the gateway and the host each mount it over
their own run and client. It only reads."""
