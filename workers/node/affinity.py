"""Where a node's token path runs: one compute core set per host.

A single-sequence pipeline runs one stage at a time: a token goes head -> ... -> last ->
driver -> head, and every other stage waits on a socket. When the stages of one pipeline
share a host, handing the token from one process to the next on the *same* core is much
cheaper than waking a process on another, idle core (measured on the 2-core dev VM:
about 0.6 ms per stage per token, 100 vs 112 tok/s for two stages). So every node of a
host pins its token-path threads (stage link, driver, direct-mode generation, and the
torch threads they start) to the same compute set: every core it may use except the first,
which is left to the control plane (Temporal, the orchestrator worker, event loops).

Only token-path threads are pinned; the node's event loop and the Temporal SDK's threads
float, so heartbeats and stream flushes never queue behind the engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def compute_set(
    setting: str | Sequence[int], available: Sequence[int] | None = None
) -> frozenset[int]:
    """The cores for the token path; empty means "do not pin".

    ``auto``: every available core but the lowest, when there are at least two.
    ``off``: no pinning. A list: those cores that are available (none available: no pinning).
    """
    cores = sorted(os.sched_getaffinity(0) if available is None else available)
    if isinstance(setting, str):
        if setting not in ("auto", "off"):
            raise ValueError(
                f"compute_cpus must be 'auto', 'off' or a list of cores, not {setting!r}"
            )
        if setting == "off" or len(cores) < 2:
            return frozenset()
        return frozenset(cores[1:])
    return frozenset(c for c in setting if c in cores)


@contextmanager
def pinned(cpus: frozenset[int]) -> Iterator[None]:
    """Pin the calling thread (only it: Linux affinity is per thread) for the block; threads
    it starts inherit the set. Restores the thread's previous set afterwards."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pin_thread(cpus: frozenset[int]) -> None:
    """Pin the calling thread for the rest of its life (a dedicated token-path thread)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
