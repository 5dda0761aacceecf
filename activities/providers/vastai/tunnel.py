"""How a node on a rented instance reaches Temporal: directly, or through a reverse tunnel.

A Temporal address the instance can reach is handed to it as it is. One that only this
host can reach (loopback, a private network) is carried to the instance by a reverse SSH
tunnel that this provider keeps up for the node's life: its end listens on the
instance's loopback, its process is recorded in the node's directory (pid and start),
and the provider's poll restarts it when it is gone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shlex
import signal
import socket
import subprocess
from pathlib import Path

import psutil

from activities.providers.pidstart import ProcessStart, recorded_alive, write_record
from activities.providers.vastai import records
from activities.providers.vastai.records import InstanceRecord
from activities.providers.vastai.ssh import SshFailed, ssh, ssh_base
from activities.providers.vastai.worker_env import settings
from temporal.connect import temporal_address

log = logging.getLogger("mvp.provider.vastai")

REMOTE_TEMPORAL_PORT = 7233  # the tunnel's end on the instance
_LOCAL_TEMPORAL = ("localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0")


def only_this_side(host: str) -> bool:
    """Whether a rented host cannot reach ``host``: a loopback, private, link-local or
    unspecified address, or a name that resolves only to such addresses (a laptop's dev
    server, a cluster's internal name). A name that does not resolve here counts as
    reachable: it is the operator's to say (``MVP_VASTAI_TEMPORAL_ADDRESS``)."""
    name = host.strip("[]")
    if name in _LOCAL_TEMPORAL:
        return True
    try:
        found = {a[4][0] for a in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    try:
        return bool(found) and all(not ipaddress.ip_address(a).is_global for a in found)
    except ValueError:
        return False


def temporal_for(record: InstanceRecord) -> str:
    """Where the node reaches Temporal: as configured when the instance can reach it,
    else through this host's reverse tunnel (its end on the instance's loopback)."""
    configured = settings().temporal_address
    if configured:
        return configured
    address = temporal_address()
    host, _, _port = address.rpartition(":")
    if not only_this_side(host):
        return address
    ensure_tunnel(record)
    return f"127.0.0.1:{REMOTE_TEMPORAL_PORT}"


def tunnel_file(label: str) -> Path:
    """The record of the node's tunnel process."""
    return records.node_dir(label) / "tunnel.json"


def ensure_tunnel(record: InstanceRecord) -> None:
    """Start the node's tunnel unless its recorded process runs; SshFailed when the
    forward does not come up."""
    if recorded_alive(tunnel_file(record.label)) is not None:
        return
    address = temporal_address()
    host, _, port = address.rpartition(":")
    host = "127.0.0.1" if host in ("localhost", "0.0.0.0") else host.strip("[]")
    base = ssh_base(record)
    cmd = [
        *base[:-1],
        "-N",
        "-o", "ExitOnForwardFailure=yes",
        "-R", f"127.0.0.1:{REMOTE_TEMPORAL_PORT}:{host}:{port}",
        base[-1],
    ]  # fmt: skip
    node_dir = records.node_dir(record.label)
    node_dir.mkdir(parents=True, exist_ok=True)
    with open(node_dir / "tunnel.log", "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    write_record(tunnel_file(record.label), proc.pid, ProcessStart.of(psutil.Process(proc.pid)))
    # The forward is up once the instance's end accepts connections.
    probe = (
        f"for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/{REMOTE_TEMPORAL_PORT}) "
        "2>/dev/null && exit 0; sleep 0.1; done; exit 1"
    )
    done = ssh(record, f"bash -c {shlex.quote(probe)}", timeout=30)
    if done.returncode != 0 or proc.poll() is not None:
        tail = (node_dir / "tunnel.log").read_text(errors="replace").strip()[-200:]
        raise SshFailed(f"the Temporal tunnel to instance {record.instance_id} is down: {tail}")
    log.info("%s: Temporal tunnel up (pid %s)", record.label, proc.pid)


def keep_tunnel_up(label: str, record: InstanceRecord) -> None:
    """Restart the tunnel of the node ``label`` if it had one and its process is gone
    (best effort)."""
    if not tunnel_file(label).exists():
        return
    with contextlib.suppress(SshFailed, OSError):
        if recorded_alive(tunnel_file(label)) is None:
            log.warning("%s: Temporal tunnel down; restarting it", label)
            ensure_tunnel(record)


def close_tunnel(label: str) -> None:
    """Stop the node's tunnel, if one runs, and drop its record."""
    tunnel = recorded_alive(tunnel_file(label))
    if tunnel is not None:
        with contextlib.suppress(OSError):
            os.killpg(tunnel.pid, signal.SIGTERM)
    with contextlib.suppress(FileNotFoundError):
        tunnel_file(label).unlink()
