"""What this host records of each node's instance, so that a retried start never rents twice.

Every instance carries the label ``mvp-<run>-<node>-<nonce8>`` (the node's resource name),
and its id is written to the node's state file (fsync, rename) before anything else
happens to it. The node's directory also holds its SSH known-hosts file, its tunnel's
record and log, and the node's log once it stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from activities.providers.base import state_dir

# A label of this provider: (run id, node id, nonce8).


@dataclass
class InstanceRecord:
    """A node's instance, as this host recorded it (state file ``instance.json``)."""

    instance_id: int
    label: str
    offer_id: int | None = None
    machine_id: int | None = None  # the host machine of the offer
    public_ip: str | None = None
    ssh_port: int | None = None
    ssh_user: str = "root"
    phases: dict[str, float] = field(default_factory=dict)


def node_dir(label: str) -> Path:
    """This host's directory of the node labelled ``label``."""
    return state_dir() / "vastai" / label


def load(label: str) -> InstanceRecord | None:
    try:
        raw = json.loads((node_dir(label) / "instance.json").read_text())
        return InstanceRecord(**raw)
    except (OSError, ValueError, TypeError):
        return None


def save(record: InstanceRecord) -> None:
    where = node_dir(record.label)
    where.mkdir(parents=True, exist_ok=True)
    tmp = where / "instance.json.tmp"
    with open(tmp, "w") as f:
        json.dump(record.__dict__, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, where / "instance.json")


def forget(label: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (node_dir(label) / "instance.json").unlink()
