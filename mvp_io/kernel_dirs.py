"""Where the engine's compiled kernel lives on a host (workers/node/engine/native.py
builds it there), shared with the Docker provider, which lends that folder to its
containers read-only so that a node there loads the host's build instead of compiling
its own at every start (DECISIONS 87)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# A folder the build is written to (instead of the user's cache).
KERNELS_DIR_ENV = "MVP_KERNELS_DIR"
# A folder searched first for a build of this source, never written (a container's
# read-only view of its host's kernel folder).
PREBUILT_ENV = "MVP_KERNELS_PREBUILT"


def kernel_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The folder this environment's builds go to first: ``MVP_KERNELS_DIR``, else
    ``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/mvp-orchestrator/kernels``."""
    env = os.environ if environ is None else environ
    if env.get(KERNELS_DIR_ENV):
        return Path(env[KERNELS_DIR_ENV])
    cache = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "mvp-orchestrator" / "kernels"
