"""A node's address-space layout (engine.address_layout).

Nodes that share a host hand every token from one process to the next on the same core
(workers/node/affinity.py). With address-space randomization each process maps Python,
torch and their libraries at different addresses, so the front-end state the last stage
left on the core (branch predictors, the micro-op cache: keyed by virtual address) does
not fit this stage's code. Started with randomization off (``ADDR_NO_RANDOMIZE``), nodes
map the same files at the same addresses and share that state. (That is our reading of
the measurement below; this VM exposes no performance counters to prove it.) Measured on the 2-core dev VM, SmolLM2 in 2 stages, paired against
the 1-stage run (scripts/bench_pipeline.py --address-layout, 3 alternating runs each):
0.92x with randomization, 0.96x without; without Temporal (scripts/bench_dataplane.py)
0.92x -> 0.95x.

The price is the loss of ASLR for those processes: a run decides it (``fixed``, or
``auto`` = only when a local provider puts several nodes on one host).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import logging
import os
import sys

log = logging.getLogger("mvp.node")

ADDR_NO_RANDOMIZE = 0x0040000
_QUERY = 0xFFFFFFFF
ENV = "MVP_ADDRESS_LAYOUT"


def _personality(persona: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.personality
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_ulong]
    return int(fn(persona))


def randomized() -> bool:
    """Whether this process runs with address-space randomization (Linux; else True)."""
    if not sys.platform.startswith("linux"):
        return True
    p = _personality(_QUERY)
    return p == -1 or not p & ADDR_NO_RANDOMIZE


def ensure_layout(setting: str | None = None) -> str | None:
    """Called first thing in a node process. With ``fixed`` (argument or MVP_ADDRESS_LAYOUT)
    and randomization still on: turn it off and exec this same command again, which does
    not return. Returns why the layout stays as it is when it cannot be changed (no Linux,
    a sandbox that forbids personality(2)), else None."""
    want = setting if setting is not None else os.environ.get(ENV, "randomized")
    if want != "fixed" or not randomized():
        return None
    if not sys.platform.startswith("linux"):
        return "address layout stays randomized: not Linux"
    current = _personality(_QUERY)
    if current == -1 or _personality(current | ADDR_NO_RANDOMIZE) == -1:
        return f"address layout stays randomized: personality(2) refused ({os.strerror(ctypes.get_errno())})"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, list(sys.orig_argv))
    except OSError as err:
        _personality(current)  # as it was: nothing changed for this process
        return f"address layout stays randomized: re-exec failed ({err})"
    raise AssertionError("unreachable")  # pragma: no cover


def map_native_libraries() -> None:
    """Map torch's native libraries now, from the one thread there is, in the order torch
    itself would (its global deps, then the Python bindings and what they link). The
    Python side of ``import torch`` may then run in a background thread while this one
    starts other threads: the big libraries, whose code is the token path, already sit at
    the same addresses in every node of a fixed layout. Best effort: torch's own import
    reports any real problem."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return
    root = next(iter(spec.submodule_search_locations))
    lib = os.path.join(root, "lib")
    try:
        ctypes.CDLL(os.path.join(lib, "libtorch_global_deps.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(os.path.join(lib, "libtorch_python.so"))
        ctypes.CDLL(os.path.join(root, "_C" + importlib.machinery.EXTENSION_SUFFIXES[0]))
    except OSError as err:
        log.info("torch libraries not mapped ahead: %s", err)
