"""Every test talks to Temporal servers it starts itself. The developer's own Temporal
settings (``TEMPORAL_ADDRESS``, an API key, TLS, a profile in
``~/.config/temporalio/temporal.toml``) would otherwise reach every client and worker
the tests make, since they all connect through envconfig (temporal/connect.py): they are
removed here, before any test, and no configuration file is read. Tests that need
settings pass them explicitly (tests/integration/test_tls.py). Here too: the session's own
layout cache, and which tests ``scripts/test --quick`` runs (the ``quick`` marker)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from temporal.connect import CONFIG_FILE_ENV, without_connection_env

_kept = without_connection_env(os.environ)
for _name in [k for k in os.environ if k not in _kept]:
    del os.environ[_name]
os.environ[CONFIG_FILE_ENV] = os.devnull

# The engine's layout cache (DECISIONS 75) is the session's own, removed after it: the
# tests' files (thousands, each written once) would otherwise fill the developer's cache
# up to its cap, and a file the tests write is never loaded by another session anyway.
# Node processes the tests start inherit it.
_LAYOUTS = tempfile.mkdtemp(prefix="mvp-test-layouts-")
os.environ["MVP_LAYOUT_CACHE"] = _LAYOUTS


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_LAYOUTS, ignore_errors=True)


# `scripts/test --quick` runs the tests marked ``quick``: the single modules mark themselves
# (``pytestmark``); these whole directories are marked here, all but the engine's tests and
# the node's pipeline tests, which load real models.
_TESTS = Path(__file__).parent
_QUICK_DIRS = ("core", "workflows", "node", "fuzz")
_NOT_QUICK = ("node/engine", "node/test_pipeline.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            rel = item.path.relative_to(_TESTS).as_posix()
        except ValueError:
            continue
        parts = rel.split("/")
        if parts[0] in _QUICK_DIRS and not any(
            rel == skip or rel.startswith(skip + "/") for skip in _NOT_QUICK
        ):
            item.add_marker(pytest.mark.quick)
