"""A rented node's last resort: destroy its own instance.

Vast.ai gives every instance its own ``CONTAINER_API_KEY`` (in the container's initial
environment, which SSH sessions do not inherit: read from ``/proc/1/environ``), good for
destroying that instance. A node whose run is closed, or that lost its lease, calls it
before it exits, so a paid instance outlives neither its run nor its orchestrator, even
when nobody is left to tear it down. Anywhere else (no key, no server URL) it does
nothing. The key is never logged.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path

# The names the Vast.ai provider sets in a rented node's environment. Read as given, not
# through VastAiEnvironment: with no server URL of its own a node is not a rented one.
from mvp_core.vastai_env import INSTANCE_ID_ENV, SERVER_URL_ENV

log = logging.getLogger("mvp.node")

DISABLED_ENV = "MVP_FAULT_NO_SELF_DESTROY"  # test harness only (the reaper's own test)


def container_environ(path: Path = Path("/proc/1/environ")) -> dict[str, str]:
    """The environment the instance's container started with (empty when unreadable)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return {}
    found: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            found[key.decode(errors="replace")] = value.decode(errors="replace")
    return found


class NodeStopReason(StrEnum):
    """Why a node stops on its own (the dead-man switch, DECISIONS 7), in its log and in
    a rented instance's self-destroy."""

    TEMPORAL_UNREACHABLE = "Temporal unreachable"
    RUN_CLOSED = "its run is closed"
    RUN_NOT_FOUND = "its run is not found"
    LEASE_STOPPED = "its lease stopped"


def self_destroy(reason: NodeStopReason | str, environ: Mapping[str, str] | None = None) -> bool:
    """Destroy this node's own instance; True once the API confirmed it (or had none)."""
    env = os.environ if environ is None else environ
    if env.get(DISABLED_ENV) == "1" and env.get("MVP_TEST_FAULTS_ALLOWED") == "1":
        log.warning("fault injection: no self-destroy (%s)", reason)
        return False
    server = env.get(SERVER_URL_ENV, "").rstrip("/")
    initial = container_environ()
    key = env.get("CONTAINER_API_KEY") or initial.get("CONTAINER_API_KEY")
    instance = env.get("CONTAINER_ID") or initial.get("CONTAINER_ID") or env.get(INSTANCE_ID_ENV)
    if not server or not key or not instance or not instance.isdigit():
        return False
    log.warning("destroying this node's own instance %s: %s", instance, reason)
    url = f"{server}/api/v0/instances/{instance}/"
    for attempt in range(6):
        req = urllib.request.Request(
            url,
            data=b"{}",
            method="DELETE",
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                json.loads(resp.read() or b"{}")
                return True
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return True  # gone already
            log.warning("self-destroy: HTTP %s (attempt %d)", err.code, attempt + 1)
        except (OSError, ValueError) as err:
            log.warning("self-destroy: %s (attempt %d)", type(err).__name__, attempt + 1)
        time.sleep(min(0.5 * 2**attempt, 8.0))
    return False
