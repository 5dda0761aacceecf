"""Every test talks to Temporal servers it starts itself. The developer's own Temporal
settings (``TEMPORAL_ADDRESS``, an API key, TLS, a profile in
``~/.config/temporalio/temporal.toml``) would otherwise reach every client and worker
the tests make, since they all connect through envconfig (temporal/connect.py): they are
removed here, before any test, and no configuration file is read. Tests that need
settings pass them explicitly (tests/integration/test_tls.py)."""

from __future__ import annotations

import os

from temporal.connect import CONFIG_FILE_ENV, without_connection_env

_kept = without_connection_env(os.environ)
for _name in [k for k in os.environ if k not in _kept]:
    del os.environ[_name]
os.environ[CONFIG_FILE_ENV] = os.devnull
