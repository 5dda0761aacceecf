"""Where and how a node's token path runs on its host.

A single-sequence pipeline runs one stage at a time: a token goes head -> ... -> last ->
driver -> head, and every other stage waits on a socket. Each hand-over is a wake-up, and
two things make wake-ups expensive on a shared host (measured on the 2-core dev VM,
SmolLM2 in two stages, see scripts/bench_pipeline.py):

- waking a process on another, idle core costs about 0.6 ms per stage per token more
  than handing over on the same core. So every node of a host pins its token-path
  threads (stage link, driver, direct-mode generation, and the torch threads they start)
  to the same compute set: by default every core it may use but the first, which is
  left to the control plane (Temporal, the orchestrator worker, event loops).
- a woken token-path thread that finds a control-plane process (the Temporal server
  writing history, the orchestrator running workflow tasks) on its core may wait for it:
  back-to-back 2-stage prompts decoded at 79-94 tok/s, and at 102-108 with the server's
  and orchestrator's main threads reniced to 10. So token-path threads run at a higher
  priority (nice -5 by default: 90-103 tok/s alone) where the node is allowed to
  (CAP_SYS_NICE or root; elsewhere they keep the default and the node logs it once),
  and the local dev server runs at nice 5 (temporal/devserver.py).

The node's other threads (event loop, Temporal SDK, data-plane acceptor) move to the
cores outside the compute set, so they never sit on the core a token is handed over on;
heartbeats and stream flushes still run, just not in a token's way.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("mvp.node")


def compute_set(
    setting: str | Sequence[int], available: Sequence[int] | None = None, *, many: bool = False
) -> frozenset[int]:
    """The cores for the token path; empty means "do not pin".

    ``auto``: every available core but the lowest, when there are at least two, for a run
    that generates one prompt at a time; none for one that generates ``many`` at once
    (DECISIONS 62: its stages work at the same time, and nodes of one host pinned to one
    shared set would take turns on it). ``off``: no pinning. A list: those cores that are
    available (none available: no pinning).
    """
    cores = sorted(os.sched_getaffinity(0) if available is None else available)
    if isinstance(setting, str):
        if setting not in ("auto", "off"):
            raise ValueError(
                f"compute_cpus must be 'auto', 'off' or a list of cores, not {setting!r}"
            )
        if setting == "off" or len(cores) < 2 or many:
            return frozenset()
        return frozenset(cores[1:])
    return frozenset(c for c in setting if c in cores)


def cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """This process's CPU limit in CPUs from its cgroup (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``/``cpu.cfs_period_us``), None without one or where unreadable."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        p = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


@dataclass(frozen=True)
class Placement:
    """The token path's cores (empty: not pinned) and nice value (None: unchanged)."""

    cpus: frozenset[int] = frozenset()
    nice: int | None = None

    def _apply(self) -> tuple[set[int], int]:
        tid = threading.get_native_id()
        before = (os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, tid))
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        if self.nice is not None and self.nice != before[1]:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, self.nice)
            except PermissionError:
                _warn_once(self.nice)
        return before

    @staticmethod
    def _restore(before: tuple[set[int], int]) -> None:
        tid = threading.get_native_id()
        os.sched_setaffinity(0, before[0])
        if os.getpriority(os.PRIO_PROCESS, tid) != before[1]:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, before[1])
            except PermissionError:
                pass  # cannot go back below: the thread keeps the token path's priority

    @contextmanager
    def applied(self) -> Iterator[None]:
        """For the block, the calling thread (only it: Linux keeps affinity and nice per
        thread) runs as the token path; threads it starts inherit that. Restored after."""
        before = self._apply()
        try:
            yield
        finally:
            self._restore(before)

    def confine_others(self) -> None:
        """Move every existing thread of this process (and so the threads they start) to
        the cores outside the compute set; token-path threads move back as they adopt."""
        if not self.cpus:
            return
        rest = os.sched_getaffinity(0) - self.cpus
        if not rest:
            return
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), rest)
            except OSError:
                pass  # a thread that just ended

    def adopt(self) -> None:
        """The calling thread is a token-path thread for the rest of its life."""
        self._apply()


_warned = False


def _warn_once(nice: int) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "token path keeps the default priority: nice %d needs CAP_SYS_NICE; "
            "busy control-plane processes on this host may slow decoding",
            nice,
        )
