"""SSH, the one channel to a rented instance: the identity, the endpoint, commands, uploads.

The identity's private key exists only in this worker's environment; its public key is
registered on the account. The first host key an instance shows is accepted and pinned for
the node's life (a known-hosts file in the node's directory). Every command runs in
batch mode with a timeout, and its input travels over stdin, never on a command line.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import shlex
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from activities.providers.base import Progress, ProviderUnavailable
from activities.providers.vastai import records
from activities.providers.vastai.api import backoff
from activities.providers.vastai.records import InstanceRecord
from activities.providers.vastai.rental import InstanceUnusable
from activities.providers.vastai.worker_env import identity_path
from mvp_core.models import ModelShare, VastAiSettings
from mvp_core.vastai_env import SSH_IDENTITY_ENV
from mvp_io import share_fetch
from mvp_io.share_fetch import HubUnreachable, ShareFetchError

log = logging.getLogger("mvp.provider.vastai")

IDENTITY_ENV = SSH_IDENTITY_ENV


class SshFailed(Exception):
    """An SSH step failed for good."""


# ---------------------------------------------------------------------- the identity
def public_key_of(identity: Path) -> str:
    """The OpenSSH public key line (``type base64``) of a private key file."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        data = identity.read_bytes()
    except OSError as err:
        raise ProviderUnavailable(
            f"missing VastAI SSH identity {identity}; create/register one with vastai "
            f"create ssh-key or set {IDENTITY_ENV} ({err.strerror})"
        ) from None
    try:
        key = serialization.load_ssh_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        # Never the key itself: the loader's words only say what kind of problem it is.
        raise ProviderUnavailable(
            f"VastAI SSH identity {identity} is not an unencrypted OpenSSH private key "
            f"({type(err).__name__})"
        ) from None
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return public.decode()


def key_body(line: str) -> str:
    """``type base64`` of a public key line, without its comment."""
    return " ".join(line.split()[:2])


def fingerprint(public: str) -> str:
    """A public key line's fingerprint (SHA256, as ssh-keygen prints it)."""
    raw = base64.b64decode(public.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")


# ---------------------------------------------------------------------- the endpoint
def mapped_port(row: dict[str, Any], port: int) -> int | None:
    """The public port an instance maps to its container ``port``, if any."""
    ports = row.get("ports") or {}
    for binding in ports.get(f"{port}/tcp") or []:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return int(binding["HostPort"])
    return None


def ssh_endpoint(row: dict[str, Any]) -> tuple[str, int]:
    """The instance's direct SSH endpoint: its public address and the port mapped to its
    container port 22, else the SSH host and port the API names."""
    ip = row.get("public_ipaddr")
    mapped = mapped_port(row, 22)
    if ip and mapped:
        return str(ip).strip(), mapped
    host, port = row.get("ssh_host"), row.get("ssh_port")
    if host and port:
        return str(host), int(port)
    raise InstanceUnusable("reports no SSH endpoint")


# ---------------------------------------------------------------------- commands
def ssh_base(record: InstanceRecord) -> list[str]:
    """The ``ssh`` command line to the instance, without the remote command."""
    known_hosts = records.node_dir(record.label) / "known_hosts"
    return [
        "ssh",
        "-i",
        str(identity_path()),
        "-p",
        str(record.ssh_port),
        "-o", "BatchMode=yes",
        "-o", "IdentitiesOnly=yes",
        # The first key an instance shows is accepted and pinned for the run.
        "-o", "StrictHostKeyChecking=accept-new",
        "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "ConnectTimeout=10",
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3",
        "-o", "LogLevel=ERROR",
        f"{record.ssh_user}@{record.public_ip}",
    ]  # fmt: skip


def ssh(
    record: InstanceRecord, command: str, *, stdin: bytes | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[bytes]:
    """Run ``command`` on the instance; SshFailed when it does not end in ``timeout``."""
    try:
        done = subprocess.run(
            [*ssh_base(record), command],
            input=stdin if stdin is not None else b"",
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise SshFailed(f"ssh to instance {record.instance_id} timed out") from None
    return done


def ssh_ok(record: InstanceRecord, command: str, what: str, **kw: Any) -> bytes:
    """The output of ``command``, logged as ``what``; SshFailed unless it exits 0."""
    log.info("%s: %s over SSH", record.label, what)
    done = ssh(record, command, **kw)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        raise SshFailed(f"{what} on instance {record.instance_id}: {why[0][:300]}")
    return done.stdout


def wait_ssh(record: InstanceRecord, s: VastAiSettings, phases: dict[str, float]) -> None:
    """Two steps, each with backoff: the SSH banner on the mapped port, then a real
    command with the identity."""
    t0 = time.monotonic()
    deadline = t0 + s.ssh_timeout_s
    waits = backoff()
    assert record.public_ip and record.ssh_port
    while True:
        try:
            with socket.create_connection((record.public_ip, record.ssh_port), timeout=5) as c:
                c.settimeout(5)
                if c.recv(64).startswith(b"SSH-"):
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise InstanceUnusable(f"no SSH banner at {record.public_ip}:{record.ssh_port}")
        time.sleep(min(next(waits), 2.0))
    while True:
        try:
            done = ssh(record, "true", timeout=20)
            if done.returncode == 0:
                phases["ssh"] = time.monotonic() - t0
                return
            why = done.stderr.decode(errors="replace").strip()[-200:]
        except SshFailed as err:
            why = str(err)
        if time.monotonic() > deadline:
            raise InstanceUnusable(f"SSH login failed: {why}")
        time.sleep(min(next(waits), 2.0))


# ---------------------------------------------------------------------- uploads
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def upload_models(record: InstanceRecord, paths: list[str], phases: dict[str, float]) -> None:
    """Copy each model file to the same path on the instance unless it holds it
    already (same size and SHA-256): the plan names it by that path."""
    t0 = time.monotonic()
    sent = 0
    for path in sorted(set(paths)):
        local = Path(path)
        size = local.stat().st_size
        digest = _sha256(local)
        q = shlex.quote(path)
        probe = ssh_ok(
            record,
            f"if [ -f {q} ] && [ $(stat -c %s {q}) = {size} ]; then sha256sum {q}; fi",
            "model probe",
        )
        if probe.split()[:1] == [digest.encode()]:
            continue
        part = shlex.quote(f"{path}.part")
        done = subprocess.run(
            [*ssh_base(record),
             f"mkdir -p {shlex.quote(str(local.parent))} && cat > {part} && "
             f"[ $(sha256sum < {part} | cut -d' ' -f1) = {digest} ] && mv {part} {q}"],
            stdin=open(local, "rb"),
            capture_output=True,
            timeout=max(120.0, size / 5e6),
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace").strip()[-200:]
            raise SshFailed(f"model upload of {local.name} failed: {why}")
        sent += size
    phases["upload"] = time.monotonic() - t0
    if sent:
        log.info("uploaded %.1f MB of model to instance %s", sent / 1e6, record.instance_id)


# ---------------------------------------------------------------------- a hub model's share
REMOTE_FETCH_DIR = "/var/lib/mvp/fetch"
FETCH_LOG_EVERY_S = 5.0


def _progress_line(line: dict[str, Any]) -> tuple[int, int] | None:
    """(bytes held, bytes in all) of a remote fetcher's progress line; None for any other
    line, or one whose figures are not two whole numbers 0 <= held <= total <= 2^53 (the
    instance's output is untrusted)."""
    done, total = line.get("done"), line.get("total")
    if type(done) is not int or type(total) is not int or not 0 <= done <= total <= 1 << 53:
        return None
    return done, total


def fetch_share_remote(
    record: InstanceRecord,
    share: ModelShare,
    token: str | None,
    phases: dict[str, float],
    progress: Progress | None = None,
) -> int:
    """The node's share of a hub model fetched on the instance itself, from the hub
        (DECISIONS 72): mvp_io/share_fetch.py (standard library only) is sent over SSH and run
        with ``python3``; the job, and the hub token where this host has one, go on its stdin
        (never a command line or a file). Progress is logged here and told to ``progress`` (the
    start activity's heartbeat details) line by line. Returns the bytes fetched;
        ShareFetchError (as planned, the share cannot be had) or HubUnreachable (try again)."""
    t0 = time.monotonic()
    d = shlex.quote(REMOTE_FETCH_DIR)
    ssh_ok(
        record,
        f"mkdir -p {d} && cat > {d}/share_fetch.py.part && mv {d}/share_fetch.py.part "
        f"{d}/share_fetch.py",
        "sending the share fetcher",
        stdin=Path(share_fetch.__file__).read_bytes(),
    )
    job = json.dumps({"share": share.model_dump(mode="json"), "token": token}) + "\n"
    deadline = t0 + max(300.0, share.size / 5e6)
    errors = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [*ssh_base(record), f"python3 {d}/share_fetch.py"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
    )
    # The deadline holds even while no line comes: killing the session ends the remote
    # fetcher too (its next progress line finds no reader, and it exits).
    watchdog = threading.Timer(max(deadline - time.monotonic(), 1.0), proc.kill)
    watchdog.start()
    assert proc.stdin is not None and proc.stdout is not None
    last: dict[str, Any] = {}
    shown = 0.0
    try:
        proc.stdin.write(job.encode())
        proc.stdin.close()
        for raw in proc.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(line, dict):
                continue
            last = line
            held = _progress_line(line)
            if held is None:
                continue
            if progress is not None:  # the start's heartbeat details, and its own log
                progress(*held)
            elif time.monotonic() - shown >= FETCH_LOG_EVERY_S:
                shown = time.monotonic()
                log.info(
                    "%s: instance %s has %.1f of %.1f MB of its share of %s",
                    record.label,
                    record.instance_id,
                    held[0] / 1e6,
                    held[1] / 1e6,
                    share.pin.describe(),
                )
        proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        errors.seek(0)
        stderr = errors.read().decode(errors="replace")
        errors.close()
    if "fetched" in last and proc.returncode == 0:
        phases["fetch"] = time.monotonic() - t0
        log.info(
            "%s: instance %s fetched %.1f MB of %s from the hub in %.1f s",
            record.label,
            record.instance_id,
            int(last["fetched"]) / 1e6,
            share.pin.describe(),
            phases["fetch"],
        )
        return int(last["fetched"])
    if "error" in last:
        text = str(last["error"])[:500]
        if last.get("retry"):
            raise HubUnreachable(f"instance {record.instance_id}: {text}")
        raise ShareFetchError(f"instance {record.instance_id}: {text}")
    if time.monotonic() >= deadline:
        raise HubUnreachable(
            f"the share fetch on instance {record.instance_id} took past its "
            f"{deadline - t0:.0f} s; what it fetched is kept for the next attempt"
        )
    if proc.returncode == 255:  # ssh's own failure: the session dropped mid-fetch
        raise HubUnreachable(
            f"the SSH session to instance {record.instance_id} ended during the share fetch; "
            "what it fetched is kept for the next attempt"
        )
    why = stderr.strip().splitlines()[-1:] or ["?"]
    raise SshFailed(
        f"the share fetch on instance {record.instance_id} exited {proc.returncode}: {why[0][:300]}"
    )
