"""Which process a recorded pid is: its start as the kernel counts it.

A pid alone may be reused, so a provider records the start of the process it launched and
checks it before it calls that pid alive or signals it. psutil's ``create_time()`` is no
such mark on Linux: it is the start in clock ticks since boot plus the boot time, which
``/proc/stat`` gives in whole seconds computed from the wall clock, so a clock step (a VM's
clock set again on a loaded host, NTP's ``makestep``) moves every process's create time,
by a whole second even for a step of a few milliseconds. A live node then looked gone
(issue 21, defect 2). The start ticks in field 22 of ``/proc/<pid>/stat`` never move; they
are the mark where there is a procfs, and the create time with a tolerance elsewhere.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

# Where there is no procfs: how far two reads of one process's create time may differ.
CREATE_TIME_TOLERANCE_S = 0.5


def start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot at the process's start);
    None where that file cannot be read (no procfs, or no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # Field 2 (the command) is parenthesised and may hold spaces and parentheses: the
    # fields after its last ')' are 3, 4, ..., so field 22 is the 20th of them.
    try:
        return int(stat[stat.rindex(b")") + 1 :].split()[19])
    except (ValueError, IndexError):
        return None


@dataclass(frozen=True)
class ProcessStart:
    """The recorded start of one process: enough to tell it from a later one of its pid."""

    create_time: float
    ticks: int | None = None

    @classmethod
    def of(cls, proc: psutil.Process) -> ProcessStart:
        """The start of a live process, read now."""
        return cls(create_time=proc.create_time(), ticks=start_ticks(proc.pid))

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> ProcessStart | None:
        """The start in a pid record (``create_time``, ``start_ticks``: a record written
        before the ticks were kept has none); None where it records no start."""
        # "started": the Vast.ai provider's tunnel record, before it was this record
        create_time = rec.get("create_time", rec.get("started"))
        if create_time is None:
            return None
        ticks = rec.get("start_ticks")
        return cls(float(create_time), None if ticks is None else int(ticks))

    def as_record(self) -> dict[str, Any]:
        return {"create_time": self.create_time, "start_ticks": self.ticks}

    def matches(self, proc: psutil.Process) -> bool:
        """Whether ``proc`` is the process this start was recorded for (not a later
        process of the same pid). Raises psutil.NoSuchProcess when it is gone."""
        if self.ticks is not None:
            now = start_ticks(proc.pid)
            if now is not None:
                return now == self.ticks
            if not psutil.pid_exists(proc.pid):
                raise psutil.NoSuchProcess(proc.pid)
        return abs(proc.create_time() - self.create_time) <= CREATE_TIME_TOLERANCE_S


def write_record(path: Path, pid: int, start: ProcessStart) -> None:
    """Record at ``path`` the process ``pid`` and its start (``{"pid", "create_time",
    "start_ticks"}``), written whole: a reader never sees half a record."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": pid, **start.as_record()}))
    os.replace(tmp, path)


def read_record(path: Path) -> tuple[int, ProcessStart | None] | None:
    """The pid and start :func:`write_record` wrote at ``path`` (the start None where the
    record has none); None where there is no readable record."""
    try:
        rec = json.loads(path.read_text())
        return int(rec["pid"]), ProcessStart.from_record(rec)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def recorded_alive(path: Path) -> psutil.Process | None:
    """The live, not zombie, process the record at ``path`` names (the very process, not
    a later one of its pid); None where there is none, or the record keeps no start."""
    pid, start = read_record(path) or (0, None)
    if start is None:
        return None
    try:
        proc = psutil.Process(pid)
        if start.matches(proc) and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None
