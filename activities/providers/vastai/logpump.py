"""A rented node's output, live (issue 38 item 1): its stdout and stderr, written on the
instance to ``node.log`` and ``node.err``, each followed over an SSH session of its own
(``tail -F`` from the first byte) into the node's directory on this host, the files the
run's datastream, the dashboard and fault texts read, as the Docker provider's LogPump
does for a container. Each session is recorded in the node's directory (pid and start,
as the Temporal tunnel is), so the provider's poll restarts one that dropped (its file
rewritten from the start) and the node's stop ends them."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import psutil

from activities.providers.base import NODE_STDERR_FILE
from activities.providers.pidstart import ProcessStart, recorded_alive, write_record
from activities.providers.vastai import records
from activities.providers.vastai.records import InstanceRecord
from activities.providers.vastai.ssh import ssh_base

log = logging.getLogger("mvp.provider.vastai")

REMOTE_NODE_DIR = "/var/lib/mvp/node"  # the node agent's directory on the instance
# (this host's file, the instance's file): stdout and stderr apart, as a process node's
STREAMS = (("node.log", "node.log"), (NODE_STDERR_FILE, NODE_STDERR_FILE))


def pump_file(label: str, local: str) -> Path:
    """The record of the session that follows ``local``'s stream."""
    return records.node_dir(label) / f"logpump-{local}.json"


RESTART_EVERY_S = 10.0  # a stream's dropped session is started again at most this often
_restarted: dict[str, float] = {}  # label -> when its sessions were last (re)started


def ensure_log_pump(record: InstanceRecord) -> None:
    """Follow each of the node's streams unless its recorded session runs (best effort:
    a stream that cannot be followed is the node's log at its stop, as before). A session
    started again goes on from the bytes this host has (the instance's files only grow),
    so a drop loses nothing and repeats nothing, and an instance that is gone leaves
    what was followed."""
    node_dir = records.node_dir(record.label)
    node_dir.mkdir(parents=True, exist_ok=True)
    _restarted[record.label] = time.monotonic()
    for local, remote in STREAMS:
        record_file = pump_file(record.label, local)
        if recorded_alive(record_file) is not None:
            continue
        target = node_dir / local
        have = target.stat().st_size if target.exists() and record_file.exists() else 0
        path = shlex.quote(f"{REMOTE_NODE_DIR}/{remote}")
        cmd = [*ssh_base(record), f"exec tail -c +{have + 1} -F {path} 2>/dev/null"]
        try:
            with open(target, "ab" if have else "wb") as out:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            write_record(record_file, proc.pid, ProcessStart.of(psutil.Process(proc.pid)))
        except (OSError, psutil.Error) as err:
            log.warning("%s: cannot follow the node's %s: %s", record.label, remote, err)


def keep_log_pump_up(label: str, record: InstanceRecord) -> None:
    """Restart a stream's session that dropped, for a node whose streams are followed
    (at most every RESTART_EVERY_S: an instance that is gone is not dialled each poll)."""
    if time.monotonic() - _restarted.get(label, 0.0) < RESTART_EVERY_S:
        return
    if any(pump_file(label, local).exists() for local, _ in STREAMS):
        ensure_log_pump(record)


def close_log_pump(label: str) -> bool:
    """End the node's sessions and drop their records; whether any was recorded (the
    local files then hold the node's output up to now)."""
    had = False
    for local, _ in STREAMS:
        record_file = pump_file(label, local)
        had = had or record_file.exists()
        session = recorded_alive(record_file)
        if session is not None:
            with contextlib.suppress(OSError):
                os.killpg(session.pid, signal.SIGTERM)
        with contextlib.suppress(FileNotFoundError):
            record_file.unlink()
    _restarted.pop(label, None)
    return had
