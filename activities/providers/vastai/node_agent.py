"""The node agent on a rented instance: its environment, its launch and its stop, over SSH.

The node's own secrets (edge token, payload key, the Temporal connection's certificates)
travel over SSH stdin into a 0600 file, never on a command line. The bootstrap command
runs detached in its own session, once per execution; a stop signals that session,
waits its grace, and keeps the node's log on this host.
"""

from __future__ import annotations

import contextlib
import shlex
import time
from typing import Any

from activities.providers.base import node_environment
from activities.providers.vastai import records
from activities.providers.vastai.logpump import REMOTE_NODE_DIR, close_log_pump
from activities.providers.vastai.records import InstanceRecord
from activities.providers.vastai.ssh import SshFailed, mapped_port, ssh, ssh_ok
from activities.providers.vastai.worker_env import server_url
from mvp_core.models import NodeProvisionSpec, VastAiSettings
from mvp_core.vastai_env import INSTANCE_ID_ENV, SERVER_URL_ENV


def bootstrap(
    record: InstanceRecord,
    spec: NodeProvisionSpec,
    s: VastAiSettings,
    row: dict[str, Any],
    temporal: str,
    phases: dict[str, float],
) -> None:
    """Write the node's environment (0600, over stdin), then start the bootstrap
    command detached in its own session, unless this execution's node runs already."""
    t0 = time.monotonic()
    mapped = mapped_port(row, s.dataplane_port)
    if mapped is None:
        raise SshFailed(
            f"instance {record.instance_id} reports no mapping of port {s.dataplane_port}"
        )
    host_env = {
        "MVP_DATAPLANE_HOST": "0.0.0.0",
        "MVP_DATAPLANE_PORT": str(s.dataplane_port),
        "MVP_ADVERTISE_HOST": str(record.public_ip),
        "MVP_ADVERTISE_PORT": str(mapped),
        SERVER_URL_ENV: server_url(),
        INSTANCE_ID_ENV: str(record.instance_id),
        "PYTHONUNBUFFERED": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "MVP_BOOTSTRAP_COMMAND": s.bootstrap_command or "",
        "MVP_NODE_RESOURCE": record.label,
    }
    # Certificates travel inline (in the 0600 env file): the instance has none of
    # this host's files.
    env = node_environment(
        spec, REMOTE_NODE_DIR, host_env=host_env, temporal_address=temporal, inline_files=True
    )
    env_file = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
    d = shlex.quote(REMOTE_NODE_DIR)
    ssh_ok(
        record,
        f"umask 077 && mkdir -p {d} && cat > {d}/node.env.part && mv {d}/node.env.part {d}/node.env",
        "writing the node environment",
        stdin=env_file.encode(),
    )
    launch = (
        f"cd {d} && "
        'if [ -f node.pid ] && kill -0 "$(cat node.pid)" 2>/dev/null; then exit 0; fi; '
        ". ./node.env && "
        'nohup setsid sh -c "$MVP_BOOTSTRAP_COMMAND" > node.log 2> node.err < /dev/null & '
        "echo $! > node.pid"
    )
    ssh_ok(record, f"sh -c {shlex.quote(launch)}", "starting the node agent")
    phases["bootstrap"] = time.monotonic() - t0


def remove_node_environment(record: InstanceRecord) -> None:
    """Remove the node's environment file once its node has read it (complete_bootstrap):
    its secrets stay in the node's memory only. The launch above reads it only where
    no node of this execution runs, which is never true again for this node."""
    d = shlex.quote(REMOTE_NODE_DIR)
    ssh_ok(record, f"rm -f {d}/node.env {d}/node.env.part", "removing the node environment")


def stop_node_agent(record: InstanceRecord, grace_s: float) -> None:
    """Best effort, bounded: SIGTERM the node's session, wait, keep its log here: what
    its followed streams hold (their sessions end now), else the log's last 2 MB."""
    d = shlex.quote(REMOTE_NODE_DIR)
    wait = max(int(grace_s * 10), 1)
    script = (
        f"cd {d} 2>/dev/null || exit 0; p=$(cat node.pid 2>/dev/null) || exit 0; "
        'kill -TERM -- "-$p" 2>/dev/null; '
        f'for i in $(seq {wait}); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done; '
        'kill -KILL -- "-$p" 2>/dev/null; tail -c 2000000 node.log 2>/dev/null; exit 0'
    )
    with contextlib.suppress(SshFailed):
        done = ssh(record, f"sh -c {shlex.quote(script)}", timeout=grace_s + 20)
        followed = close_log_pump(record.label)
        if done.returncode == 0 and not followed:
            node_dir = records.node_dir(record.label)
            node_dir.mkdir(parents=True, exist_ok=True)
            (node_dir / "node.log").write_bytes(done.stdout)
