"""A stand-in for the Vast.ai API, for tests: an HTTP server that speaks the wire protocol
of the official ``vastai`` SDK (1.9.1), whose instances are real SSH hosts.

Every instance is a container on a private Docker daemon (tests/helpers/dockerd.py) running
the host's own ``/usr/sbin/sshd`` from a skeleton root filesystem, with the host's ``/usr``,
Python, virtual environment and this repository bind-mounted read-only at the same paths
(as the Docker provider's host image does), so ``sys.executable`` runs inside an instance.

Networking. The stand-in makes one user-defined bridge network, ``vast-standin-<id>``,
with inter-container traffic disabled (``enable_icc=false``): instances cannot reach each
other's container addresses, only published ports, as on Vast. The network's gateway
address G is the instances' "public IP" (``public_ipaddr``/``ssh_host`` of every row), and
the HTTP server binds G too, so ``standin.url`` works from the host and from inside
instances. Each instance publishes 22/tcp and every ``-p N:N`` of its create env on host
ports bound to G that the stand-in picks itself (20000-32000, outside the kernel's
ephemeral range) before the container is made, because ``VAST_TCP_PORT_<N>`` has to be in
the container's environment when it starts. Hairpin works with the daemon's defaults: an
instance that connects to ``G:<mapped port>`` of a peer (or its own) reaches the daemon's
userland proxy on the host (its DNAT rules skip traffic from the bridge itself), which
forwards to the peer. One difference to keep in mind: from the host, a published port
with nothing listening behind it refuses the connection (DNAT straight to the container),
but from inside an instance the connect *succeeds* and then closes without a byte (the
proxy accepts first). Only the SSH banner says sshd is up; the stand-in waits for it too.
The rows report ``HostIp`` "0.0.0.0" as Vast does, although the binding is on G.

Instance environment (PID 1's only: SSH sessions do not see it, ``/proc/1/environ`` does):
the plain ``KEY: value`` entries of the create env, ``CONTAINER_ID``, ``CONTAINER_API_KEY``
(a key of the instance's own, which may only destroy that instance), ``VAST_CONTAINERLABEL``
(``C.<id>``), ``PUBLIC_IPADDR`` (G), ``VAST_TCP_PORT_22`` and ``VAST_TCP_PORT_<N>``. An
``onstart`` command is written to ``/root/onstart.sh`` and runs in the background (output
in ``/var/log/onstart.log``) before sshd starts.

Lifecycle of ``actual_status``: ``None`` for ``null_status_s`` after create, then
``"loading"`` until the container runs and sshd answers with its banner on the mapped port,
then ``"running"``; ``"exited"`` once the container's PID 1 is gone; ``"stopped"`` after a
``PUT {"state": "stopped"}``. ``ssh_port`` is ``None`` and ``ports`` ``{}`` until the
container has started. Destroying with the account key removes the container before the
answer; with the instance's own key (a self-destroy from inside) the answer goes first.

The ledger (``ledger()``, ``left_behind()``, ``billed_seconds()``, ``creates_per_label()``,
``requests``, ``timeline``) is the tests' oracle. ``close()`` removes every container and the network the
stand-in made (found by the ``vast-standin=<id>`` label) but leaves the ledger as it was,
so a check after close still sees what a client left behind. ``switches`` inject faults;
``switches.rate_limits`` answers chosen requests HTTP 429 with ``Retry-After``, as the API
does when a client goes over its rate limit (``rate_limit_burst`` does so without one).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import json
import os
import random
import re
import secrets
import socket
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import cmp_to_key
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import docker
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from docker.errors import DockerException, NotFound
from docker.types import Mount

LABEL = "vast-standin"  # value: the stand-in's random id, on every container and network
LABEL_INSTANCE = "vast-standin.instance"
IMAGE_REPO = "vast-standin/host"
ROOTFS_FORMAT = 1  # bump when _rootfs() changes: the image tag changes with it
FIRST_INSTANCE_ID = 9000001
FIRST_KEY_ID = 4001
REPO = Path(__file__).resolve().parents[2]
HOST_KEY = "/etc/ssh/ssh_host_ed25519_key"
SSHD = "/usr/sbin/sshd"
SSHD_ARGS = (
    "-D -e -p 22 -o PermitRootLogin=prohibit-password -o PasswordAuthentication=no "
    "-o UsePAM=no -o AllowTcpForwarding=yes -o GatewayPorts=no -o StrictModes=no "
    f"-h {HOST_KEY}"
)
PORT_RANGE = (20000, 32000)  # below the kernel's ephemeral range (32768-60999)
OPS = ("eq", "neq", "gt", "gte", "lt", "lte", "in", "notin")
SEARCH_RESERVED = {"order", "type", "limit", "allocated_storage", "disable_bundling"}
SSH_KEY_TYPES = {
    "ssh-ed25519",
    "ssh-rsa",
    "ssh-dss",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
}
_PORT_KEY = re.compile(r"^-p\s+(?:(\d+):)?(\d+)(?:/(tcp|udp))?$")

# Host ports handed out by any stand-in of this process, until their instance is destroyed.
_reserved_ports: set[int] = set()
_ports_lock = threading.Lock()


@dataclass
class RateLimit:
    """The next ``times`` requests whose method is ``method`` (None: any) and whose path
    matches ``path`` (a regular expression, searched) answer HTTP 429 ``rate_limited``
    with ``Retry-After: <retry_after>`` (None: no header), before any other check, as
    Vast.ai's rate limiter answers before it serves anything."""

    times: int
    retry_after: str | None = "2"
    method: str | None = None
    path: str = ""
    answered: int = 0  # how many 429s this rule gave


@dataclass
class Switches:
    """Fault injection: each counter makes the next N matching calls misbehave."""

    rate_limit_burst: int = 0  # any request: 429 rate_limited, no Retry-After
    rate_limits: list[RateLimit] = field(default_factory=list)  # 429 with Retry-After
    vanish_offers: int = 0  # create: 400 no_such_ask, the offer gone for good
    stuck_loading: int = 0  # created instances: "loading" forever, sshd never starts
    exit_on_start: int = 0  # created instances: None -> loading -> exited
    create_error_with_contract: int = 0  # create: made, yet 500 with new_contract
    list_without_instances_key: int = 0  # v1 list: 200 {"next_token": null}
    destroy_failures: int = 0  # DELETE instance: 500, not destroyed


@dataclass
class InstanceRecord:
    """One instance ever created, as the stand-in knows it (a copy: mutate freely)."""

    id: int
    label: str | None
    offer_id: int
    image: str | None
    created_at: float
    running_at: float | None = None
    destroyed_at: float | None = None
    status: str | None = None
    status_msg: str = ""
    mode: str = "normal"  # normal | stuck_loading | exit_on_start
    env: dict[str, str] = field(default_factory=dict)  # the plain entries of the create env
    requested_ports: list[int] = field(default_factory=list)
    ports: dict[int, int] = field(default_factory=dict)  # container port -> host port
    onstart: str | None = None
    disk: float | None = None
    runtype: str | None = None
    create_answered_error: bool = False  # create_error_with_contract made this one
    stop_calls: int = 0  # PUT state=stopped (a provider must never do that)
    stopped_at: float | None = None
    exited_at: float | None = None
    exit_code: int | None = None
    container_id: str | None = None
    container_name: str = ""
    ssh_keys: list[str] = field(default_factory=list)  # authorized at create
    host_public_key: str = ""  # the instance's sshd host key (for known_hosts pinning)
    provision_error: str | None = None
    container_api_key: str = field(default="", repr=False)

    @property
    def ssh_port(self) -> int | None:
        return self.ports.get(22)


class _Reply(Exception):
    def __init__(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or {}


def _error(status: int, error: str, msg: str, **extra: Any) -> _Reply:
    return _Reply(status, {"success": False, "error": error, "msg": msg, **extra})


@dataclass
class _Instance:
    rec: InstanceRecord
    offer: dict[str, Any]
    op_lock: threading.Lock = field(default_factory=threading.Lock)
    intended: str = "running"
    started: bool = False
    restarted_at: float = 0.0


def default_offers(public_ip: str) -> list[dict[str, Any]]:
    """Six offers: three match reliability>=0.95, one direct port at least and one GPU; the
    others have two GPUs, low reliability (unverified) or no direct ports."""

    def offer(
        n: int,
        gpu: str,
        gpus: int,
        gpu_ram: int,
        dph: float,
        rel: float,
        ports: int,
        geo: str,
        verified: bool = True,
        **more: Any,
    ) -> dict[str, Any]:
        oid = 31_800_000 + n * 1117
        return {
            "id": oid,
            "ask_contract_id": oid,
            "bundle_id": 700_000 + n,
            "machine_id": 41_000 + n * 13,
            "host_id": 188_000 + n * 7,
            "num_gpus": gpus,
            "gpu_name": gpu,
            "gpu_ram": gpu_ram,
            "gpu_total_ram": gpu_ram * gpus,
            "gpu_frac": 1.0,
            "cpu_name": "AMD EPYC 7B13 64-Core Processor",
            "cpu_cores": 32 * gpus,
            "cpu_cores_effective": 16.0 * gpus,
            "cpu_ram": 128_000 * gpus,
            "disk_space": 500.0,
            "disk_bw": 2400.0,
            "dph_base": round(dph * 0.95, 4),
            "dph_total": dph,
            "min_bid": round(dph * 0.5, 4),
            "storage_cost": 0.15,
            "reliability": rel,
            "reliability2": rel,
            "inet_down": 900.0 + n * 10,
            "inet_up": 600.0 + n * 10,
            "verified": verified,
            "external": False,
            "rentable": True,
            "rented": False,
            "hosting_type": 0,
            "direct_port_count": ports,
            "public_ipaddr": public_ip,
            "static_ip": True,
            "geolocation": geo,
            "cuda_max_good": 12.4,
            "driver_version": "550.54.14",
            "compute_cap": 890 if "4090" in gpu else 860 if "3090" in gpu else 800,
            "duration": 2_592_000.0,
            "score": round(rel * 100 / (1 + dph), 3),
            **more,
        }

    return [
        offer(1, "RTX 4090", 1, 24564, 0.35, 0.995, 100, "Quebec, CA"),
        offer(2, "RTX 3090", 1, 24576, 0.22, 0.981, 50, "Oregon, US"),
        offer(3, "A100 SXM4", 1, 81920, 1.10, 0.999, 200, "Frankfurt, DE"),
        offer(4, "RTX 4090", 2, 24564, 0.72, 0.972, 100, "Texas, US"),
        offer(5, "RTX 3090", 1, 24576, 0.15, 0.912, 20, "Sao Paulo, BR", verified=False),
        offer(6, "RTX 4090", 1, 24564, 0.30, 0.990, 0, "Helsinki, FI"),
    ]


# --------------------------------------------------------------------------- filters
def _match_op(value: Any, op: str, want: Any, present: bool) -> bool:
    if op not in OPS:
        raise _error(400, "invalid_query", f"unknown operator {op!r}")
    if not present:
        return op in ("neq", "notin")
    try:
        if op == "eq":
            return bool(value == want)
        if op == "neq":
            return bool(value != want)
        if op in ("in", "notin"):
            if not isinstance(want, list):
                raise _error(400, "invalid_query", f"{op!r} needs a list, got {want!r}")
            return (value in want) == (op == "in")
        if value is None or want is None or isinstance(value, str) != isinstance(want, str):
            return False
        if op == "gt":
            return bool(value > want)
        if op == "gte":
            return bool(value >= want)
        if op == "lt":
            return bool(value < want)
        return bool(value <= want)
    except TypeError:
        return False


def matches(item: dict[str, Any], filters: dict[str, Any]) -> bool:
    """Whether ``item`` passes every ``{field: {op: value}}`` filter (a bare value is eq).
    A field the item lacks passes only neq and notin."""
    for name, cond in filters.items():
        conds = cond if isinstance(cond, dict) else {"eq": cond}
        for op, want in conds.items():
            if not _match_op(item.get(name), str(op), want, name in item):
                return False
    return True


def _norm(value: Any) -> list[Any]:
    """A sort key of one value that compares across types (None first)."""
    if value is None:
        return [0, 0]
    if isinstance(value, bool | int | float):
        return [1, value]
    if isinstance(value, str):
        return [2, value]
    return [3, json.dumps(value, sort_keys=True, default=str)]


def _cmp_keys(a: list[list[Any]], b: list[list[Any]], desc: list[bool]) -> int:
    for x, y, d in zip(a, b, desc, strict=False):
        c = (x > y) - (x < y)
        if c:
            return -c if d else c
    return 0


def _sorted(
    items: list[dict[str, Any]], order: list[tuple[str, bool]]
) -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], list[list[Any]]], list[bool]]:
    cols = [*order, ("id", False)]
    desc = [d for _, d in cols]

    def key(item: dict[str, Any]) -> list[list[Any]]:
        return [_norm(item.get(c)) for c, _ in cols]

    def compare(a: dict[str, Any], b: dict[str, Any]) -> int:
        return _cmp_keys(key(a), key(b), desc)

    return sorted(items, key=cmp_to_key(compare)), key, desc


# --------------------------------------------------------------------------- images
def _host_mounts() -> list[str]:
    mounts = sorted(
        {"/usr", os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), str(REPO)}
    )
    return [m for m in mounts if not any(m.startswith(o + "/") for o in mounts if o != m)]


def _tar(entries: list[tuple[str, bytes | None, int]], links: dict[str, str]) -> bytes:
    """A tar of directories (data None) and files, all root-owned, and symlinks."""
    buf = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, data, mode in entries:
            info = tarfile.TarInfo(path)
            info.mode, info.mtime, info.uid, info.gid = mode, now, 0, 0
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        for path, target in links.items():
            info = tarfile.TarInfo(path)
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, now
            tar.addfile(info)
    return buf.getvalue()


def _rootfs() -> bytes:
    """A root filesystem with nothing of its own but what sshd needs: its privilege
    separation user and directory, a config file and root's ~/.ssh."""
    dirs = ["usr", "etc", "etc/ssh", "proc", "sys", "dev", "run", "var", "var/lib"]
    dirs += ["var/log", "var/empty", "sbin", "home"]  # /sbin: the daemon mounts its init there
    entries: list[tuple[str, bytes | None, int]] = [(d, None, 0o755) for d in dirs]
    entries += [("root", None, 0o700), ("root/.ssh", None, 0o700), ("tmp", None, 0o1777)]
    entries += [("run/sshd", None, 0o755), ("var/tmp", None, 0o1777)]
    passwd = (
        "root:x:0:0:root:/root:/bin/sh\n"
        "sshd:x:101:65534::/run/sshd:/usr/sbin/nologin\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    files = {
        "etc/passwd": (passwd.encode(), 0o644),
        "etc/group": (b"root:x:0:\nnogroup:x:65534:\n", 0o644),
        "etc/shadow": (b"root:*:19000:0:99999:7:::\nsshd:*:19000:0:99999:7:::\n", 0o640),
        "etc/nsswitch.conf": (
            b"passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n",
            0o644,
        ),
        "etc/ssh/sshd_config": (b"# vast stand-in: options come on the command line\n", 0o644),
        "etc/shells": (b"/bin/sh\n/usr/bin/sh\n/bin/bash\n/usr/bin/bash\n", 0o644),
    }
    for name in ("etc/ld.so.cache", "etc/ssh/moduli"):
        with contextlib.suppress(OSError):
            files[name] = (Path("/" + name).read_bytes(), 0o644)
    entries += [(p, data, mode) for p, (data, mode) in files.items()]
    links = {}
    for name in ("bin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/" + name)
        if host.is_symlink():
            links[name] = os.readlink(host).lstrip("/")
        elif host.is_dir():
            links[name] = f"usr/{name}"  # not merged-/usr: close enough for sh and python
    links["var/run"] = "../run"
    return _tar(entries, links)


def _host_key() -> tuple[bytes, str]:
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return private, public.decode()


def _key_identity(text: str) -> tuple[str, str] | None:
    """(type, base64 body) of an OpenSSH public key line, or None when it is not one."""
    parts = text.strip().split()
    if len(parts) < 2 or parts[0] not in SSH_KEY_TYPES:
        return None
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except (binascii.Error, ValueError):
        return None
    n = int.from_bytes(blob[:4], "big") if len(blob) >= 4 else -1
    if blob[4 : 4 + n] != parts[0].encode():
        return None
    return parts[0], parts[1]


def _banner(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            return conn.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _allocate_ports(n: int) -> list[int]:
    out: list[int] = []
    with _ports_lock:
        for _ in range(10_000):
            if len(out) == n:
                break
            p = random.randint(*PORT_RANGE)
            if p not in _reserved_ports and p not in out and _port_free(p):
                out.append(p)
        if len(out) < n:
            raise RuntimeError("no free host ports left for the stand-in")
        _reserved_ports.update(out)
    return out


def _release_ports(ports: list[int]) -> None:
    with _ports_lock:
        _reserved_ports.difference_update(ports)


# --------------------------------------------------------------------------- the server
class _Server(ThreadingHTTPServer):
    daemon_threads = True
    standin: VastStandin


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def _serve(self) -> None:
        after: Callable[[], None] | None = None
        path = urlsplit(self.path).path
        try:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length > 0 else b""
            status, body, after, headers = self.server.standin._dispatch(
                self.command, self.path, self.headers.get("Authorization"), raw
            )
        except Exception as err:  # never let a request take the server down
            status, headers = 500, {}
            body = {"success": False, "error": "internal_error", "msg": f"stand-in: {err!r}"}
        self.server.standin._log_request(self.command, path, status)
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            pass
        if after is not None:
            with contextlib.suppress(Exception):
                after()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _serve

    def log_message(self, format: str, *args: Any) -> None:
        pass


class VastStandin:
    """The stand-in API and its ledger. Make it with :func:`start_standin`."""

    def __init__(
        self,
        docker_client: docker.DockerClient,
        api_key: str | None = None,
        offers: list[dict[str, Any]] | None = None,
        *,
        null_status_s: float = 0.3,
        min_loading_s: float = 0.0,
        exit_after_s: float = 1.0,
        poll_s: float = 0.2,
    ) -> None:
        self.docker = docker_client
        self.api_key = api_key or f"vast-standin-{secrets.token_hex(16)}"
        self.id = secrets.token_hex(3)
        self.null_status_s = null_status_s
        self.min_loading_s = min_loading_s
        self.exit_after_s = exit_after_s
        self.poll_s = poll_s
        self.switches = Switches()
        self.requests: list[tuple[str, str, int]] = []
        self.searches: list[dict[str, Any]] = []  # each search's filters, in order
        # Every request as (time.monotonic() when answered, method, path, status).
        self.timeline: list[tuple[float, str, str, int]] = []
        self._lock = threading.RLock()
        self._instances: dict[int, _Instance] = {}
        self._keys: list[dict[str, Any]] = []
        self._next_id = FIRST_INSTANCE_ID
        self._next_key_id = FIRST_KEY_ID
        self._labels_created: list[str | None] = []
        self._closing = threading.Event()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self.network_name = f"vast-standin-{self.id}"
        self.image = self._ensure_image()
        net = self.docker.networks.create(
            self.network_name,
            driver="bridge",
            labels={LABEL: self.id},
            options={"com.docker.network.bridge.enable_icc": "false"},
        )
        try:
            net.reload()
            self.public_ip: str = str(net.attrs["IPAM"]["Config"][0]["Gateway"])
            self._offers = [
                dict(o) for o in (default_offers(self.public_ip) if offers is None else offers)
            ]
            for o in self._offers:
                o.setdefault("ask_contract_id", o["id"])
                o.setdefault("public_ipaddr", self.public_ip)
                o.setdefault("rentable", True)
                o.setdefault("rented", False)
            self._vanished: set[int] = set()
            self._server = _Server((self.public_ip, 0), _Handler)
        except BaseException:
            with contextlib.suppress(DockerException):
                net.remove()
            raise
        self._server.standin = self
        self.port: int = self._server.server_address[1]
        self.url = f"http://{self.public_ip}:{self.port}"
        self._spawn(self._server.serve_forever, "vast-standin-http")
        self._spawn(self._monitor, "vast-standin-monitor")

    # ------------------------------------------------------------------ public
    def __enter__(self) -> VastStandin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ledger(self) -> list[InstanceRecord]:
        with self._lock:
            return [self._copy(i) for _, i in sorted(self._instances.items())]

    def record(self, instance_id: int) -> InstanceRecord:
        with self._lock:
            return self._copy(self._instances[instance_id])

    def left_behind(self) -> list[InstanceRecord]:
        """Instances never destroyed, whatever their status."""
        return [r for r in self.ledger() if r.destroyed_at is None]

    def billed_seconds(self, instance_id: int) -> float:
        with self._lock:
            rec = self._instances[instance_id].rec
            return (rec.destroyed_at or time.time()) - rec.created_at

    def creates_per_label(self) -> dict[str | None, int]:
        with self._lock:
            out: dict[str | None, int] = {}
            for label in self._labels_created:
                out[label] = out.get(label, 0) + 1
            return out

    def offers(self) -> list[dict[str, Any]]:
        """Every offer as it stands now (vanished ones too), copies."""
        with self._lock:
            return [dict(o, vanished=o["id"] in self._vanished) for o in self._offers]

    def ssh_keys(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(k) for k in self._keys]

    def container_logs(self, instance_id: int) -> str:
        """The container's output (sshd logs with -e), for diagnosing a test."""
        cid = self.record(instance_id).container_id
        if cid is None:
            return ""
        try:
            return bytes(self.docker.containers.get(cid).logs()).decode(errors="replace")
        except DockerException as err:
            return f"<no logs: {err}>"

    def destroy(self, instance_id: int) -> bool:
        """Destroy as the account would (no switches): for test clean-up."""
        try:
            self._destroy(instance_id, sync=True)
        except _Reply:
            return False
        return True

    def close(self) -> None:
        """Stop the server and remove every container and the network of this stand-in.
        Idempotent. The ledger is left as it is."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._closing.set()
        with contextlib.suppress(Exception):
            self._server.shutdown()
        with contextlib.suppress(Exception):
            self._server.server_close()
        for t in list(self._threads):
            if t is not threading.current_thread():
                t.join(timeout=30)
        ours: dict[str, str | list[str] | bool] = {"label": [f"{LABEL}={self.id}"]}
        with contextlib.suppress(DockerException):
            for c in self.docker.containers.list(all=True, filters=ours):
                with contextlib.suppress(DockerException):
                    c.remove(force=True)
        with contextlib.suppress(DockerException):
            for n in self.docker.networks.list(filters=ours):
                with contextlib.suppress(DockerException):
                    n.remove()
        with self._lock:
            ports = [p for i in self._instances.values() for p in i.rec.ports.values()]
        _release_ports(ports)

    # ------------------------------------------------------------------ internals
    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    def _copy(self, inst: _Instance) -> InstanceRecord:
        rec = inst.rec
        return replace(
            rec,
            status=self._status(inst),
            env=dict(rec.env),
            requested_ports=list(rec.requested_ports),
            ports=dict(rec.ports),
            ssh_keys=list(rec.ssh_keys),
        )

    def _status(self, inst: _Instance) -> str | None:
        if inst.rec.status == "loading" and time.time() - inst.rec.created_at < self.null_status_s:
            return None
        return inst.rec.status

    def _take(self, name: str) -> bool:
        with self._lock:
            n = int(getattr(self.switches, name))
            if n > 0:
                setattr(self.switches, name, n - 1)
                return True
            return False

    def _log_request(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests.append((method, path, status))
            self.timeline.append((time.monotonic(), method, path, status))

    def _rate_limited(self, method: str, path: str) -> _Reply | None:
        with self._lock:
            for rule in self.switches.rate_limits:
                if rule.times <= 0 or (rule.method is not None and rule.method != method):
                    continue
                if not re.search(rule.path, path):
                    continue
                rule.times -= 1
                rule.answered += 1
                reply = _error(429, "rate_limited", "API requests too frequent: slow down")
                if rule.retry_after is not None:
                    reply.headers["Retry-After"] = rule.retry_after
                return reply
        return None

    def _ensure_image(self) -> str:
        mounts = _host_mounts()
        digest = hashlib.sha256(json.dumps([ROOTFS_FORMAT, mounts]).encode()).hexdigest()[:12]
        tag = f"{IMAGE_REPO}:{digest}"
        try:
            self.docker.images.get(tag)
        except docker.errors.ImageNotFound:
            self.docker.api.import_image_from_data(
                _rootfs(), repository=IMAGE_REPO, tag=digest, changes=["WORKDIR /root"]
            )
        return tag

    # ------------------------------------------------------------------ dispatch
    def _dispatch(
        self, method: str, target: str, auth: str | None, raw: bytes
    ) -> tuple[int, Any, Callable[[], None] | None, dict[str, str]]:
        try:
            limited = self._rate_limited(method, urlsplit(target).path)
            if limited is not None:
                raise limited
            return (*self._route(method, target, auth, raw), {})
        except _Reply as reply:
            return reply.status, reply.body, None, reply.headers

    def _route(
        self, method: str, target: str, auth: str | None, raw: bytes
    ) -> tuple[int, Any, Callable[[], None] | None]:
        parts = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        if self._take("rate_limit_burst"):
            raise _error(429, "rate_limited", "API requests too frequent: slow down")
        given = (auth or "").strip()
        token = given[7:].strip() if given.lower().startswith("bearer ") else query.get("api_key")
        principal: int | None = None  # None: the account; else the instance the key is for
        if not token:
            raise _error(401, "invalid_api_key", "no API key given")
        given_b = token.encode("utf-8", "surrogateescape")
        if not secrets.compare_digest(given_b, self.api_key.encode()):
            with self._lock:
                owner = [
                    i.rec.id
                    for i in self._instances.values()
                    if secrets.compare_digest(given_b, i.rec.container_api_key.encode())
                ]
            if not owner:
                raise _error(401, "invalid_api_key", "the API key is not valid")
            principal = owner[0]
        body: Any = None
        if raw.strip():
            try:
                body = json.loads(raw)
            except ValueError:
                raise _error(400, "invalid_json", "the request body is not JSON") from None
        segs = [s for s in parts.path.split("/") if s]
        version, rest = (segs[1], segs[2:]) if segs[:1] == ["api"] and len(segs) > 1 else ("", [])

        def ident(s: str) -> int:
            if not s.isdigit():
                raise _error(404, "not_found", f"no such path {parts.path}")
            return int(s)

        if principal is not None:
            if not (
                version == "v0"
                and method == "DELETE"
                and len(rest) == 2
                and rest[0] == "instances"
                and rest[1] == str(principal)
            ):
                raise _Reply(403, {"success": False, "error": "forbidden", "msg": "not allowed"})
        after: Callable[[], None] | None = None
        if version == "v0" and rest == ["ssh"] and method == "GET":
            with self._lock:
                return 200, [dict(k) for k in self._keys], None
        if version == "v0" and rest == ["ssh"] and method == "POST":
            return 200, self._add_key(body), None
        if version == "v0" and len(rest) == 2 and rest[0] == "ssh" and method == "DELETE":
            return 200, self._delete_key(ident(rest[1])), None
        if version == "v0" and rest == ["bundles"] and method == "POST":
            return 200, {"offers": self._search(body)}, None
        if version == "v0" and len(rest) == 2 and rest[0] == "asks" and method == "PUT":
            return self._create(ident(rest[1]), body)
        if version == "v1" and rest == ["instances"] and method == "GET":
            return 200, self._list_v1(query), None
        if version == "v0" and rest == ["instances"] and method == "GET":
            raise _error(410, "deprecated", "use /api/v1/instances/")
        if version == "v0" and len(rest) == 2 and rest[0] == "instances":
            iid = ident(rest[1])
            if method == "GET":
                with self._lock:
                    inst = self._instances.get(iid)
                    live = inst is not None and inst.rec.destroyed_at is None
                    return 200, {"instances": self._row(inst) if inst and live else None}, None
            if method == "DELETE":
                if self._take("destroy_failures"):
                    raise _error(500, "internal_error", "destroy failed, try again")
                after = self._destroy(iid, sync=principal is None)
                return 200, {"success": True}, after
            if method == "PUT":
                return 200, self._put_instance(iid, body), None
        raise _error(404, "not_found", f"no such endpoint: {method} {parts.path}")

    # ------------------------------------------------------------------ keys
    def _add_key(self, body: Any) -> dict[str, Any]:
        text = body.get("ssh_key") if isinstance(body, dict) else None
        ident = _key_identity(text) if isinstance(text, str) else None
        if ident is None:
            raise _error(400, "invalid_ssh_key", "ssh_key is not an OpenSSH public key")
        with self._lock:
            if any(_key_identity(k["public_key"]) == ident for k in self._keys):
                raise _error(400, "duplicate_key", "this SSH key is already registered")
            key = {
                "id": self._next_key_id,
                "user_id": 1,
                "public_key": str(text).strip(),
                "created_at": time.time(),
            }
            self._next_key_id += 1
            self._keys.append(key)
            return {"success": True, "key": dict(key)}

    def _delete_key(self, key_id: int) -> dict[str, Any]:
        with self._lock:
            kept = [k for k in self._keys if k["id"] != key_id]
            if len(kept) == len(self._keys):
                raise _error(404, "no_such_key", f"no SSH key {key_id}")
            self._keys = kept
        return {"success": True}

    # ------------------------------------------------------------------ offers
    def _search(self, body: Any) -> list[dict[str, Any]]:
        q = body if isinstance(body, dict) else {}
        if body is not None and not isinstance(body, dict):
            raise _error(400, "invalid_query", "the query must be an object")
        filters = {k: v for k, v in q.items() if k not in SEARCH_RESERVED}
        with self._lock:
            self.searches.append(dict(filters))
        order: list[tuple[str, bool]] = []
        for item in q.get("order") or []:
            if not isinstance(item, list | tuple) or not item:
                raise _error(400, "invalid_query", f"bad order entry {item!r}")
            order.append((str(item[0]), len(item) > 1 and str(item[1]).lower() == "desc"))
        limit = q.get("limit")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise _error(400, "invalid_query", f"bad limit {limit!r}")
        with self._lock:
            pool = [dict(o) for o in self._offers if o["id"] not in self._vanished]
        found = [o for o in pool if matches(o, filters)]
        found, _, _ = _sorted(found, order) if order else (found, None, None)
        return found[:limit] if limit is not None else found

    # ------------------------------------------------------------------ create
    def _create(self, offer_id: int, body: Any) -> tuple[int, Any, None]:
        if not isinstance(body, dict):
            raise _error(400, "invalid_args", "the create request needs a JSON object")
        env_in = body.get("env") or {}
        if not isinstance(env_in, dict):
            raise _error(400, "invalid_args", "env must be an object")
        with self._lock:
            offer = next((o for o in self._offers if o["id"] == offer_id), None)
            if self._take("vanish_offers"):
                if offer is not None:
                    self._vanished.add(offer_id)
                    offer["rented"], offer["rentable"] = True, False
                raise _error(400, "no_such_ask", "Instance type no longer available.")
            if offer is None or offer_id in self._vanished or offer.get("rented"):
                raise _error(400, "no_such_ask", "Instance type no longer available.")
        env: dict[str, str] = {}
        ports: list[int] = []
        for k, v in env_in.items():
            key = str(k)
            m = _PORT_KEY.match(key.strip())
            if m:
                if (m.group(3) or "tcp") == "tcp" and int(m.group(2)) not in ports:
                    ports.append(int(m.group(2)))
            elif not key.startswith("-"):
                if not key or "=" in key or "\0" in key or "\0" in str(v):
                    raise _error(400, "invalid_args", f"bad environment variable {key!r}")
                env[key] = "" if v is None else str(v)
        if not all(0 < p < 65536 for p in ports):
            raise _error(400, "invalid_args", f"bad port in {ports}")
        label = body.get("label")
        with self._lock:
            if offer.get("rented"):
                raise _error(400, "no_such_ask", "Instance type no longer available.")
            iid = self._next_id
            self._next_id += 1
            mode = "normal"
            if self._take("stuck_loading"):
                mode = "stuck_loading"
            elif self._take("exit_on_start"):
                mode = "exit_on_start"
            error = self._take("create_error_with_contract")
            offer["rented"] = True
            rec = InstanceRecord(
                id=iid,
                label=None if label is None else str(label),
                offer_id=offer_id,
                image=body.get("image") or body.get("template_hash_id"),
                created_at=time.time(),
                status="loading",  # shown as None for null_status_s
                status_msg="Instance created, provisioning",
                mode=mode,
                env=env,
                requested_ports=ports,
                onstart=body.get("onstart") or None,
                disk=body.get("disk"),
                runtype=body.get("runtype"),
                create_answered_error=error,
                container_name=f"vast-standin-{self.id}-C.{iid}",
                ssh_keys=[k["public_key"] for k in self._keys],
                container_api_key=secrets.token_hex(16),
            )
            self._instances[iid] = _Instance(rec=rec, offer=offer)
            self._labels_created.append(rec.label)
        self._spawn(lambda: self._provision(iid), f"vast-standin-provision-{iid}")
        if error:
            raise _error(
                500,
                "internal_error",
                "an error occurred while creating the instance",
                new_contract=iid,
            )
        return 200, {"success": True, "new_contract": iid}, None

    def _command(self, rec: InstanceRecord) -> list[str]:
        script = "mkdir -p /run/sshd && chmod 0755 /run/sshd; "
        if rec.onstart:
            script += "(sh /root/onstart.sh >/var/log/onstart.log 2>&1 &); "
        if rec.mode == "stuck_loading":
            script += "exec /usr/bin/sleep 2147483647"
        elif rec.mode == "exit_on_start":
            script += (
                f"/usr/bin/sleep {self.exit_after_s}; "
                "echo 'vast stand-in: exit_on_start' >&2; exit 1"
            )
        else:
            script += f"exec {SSHD} {SSHD_ARGS}"
        return ["/bin/sh", "-c", script]

    def _provision(self, iid: int) -> None:
        with self._lock:
            inst = self._instances[iid]
        rec = inst.rec
        try:
            with inst.op_lock:
                self._provision_locked(inst)
        except Exception as err:
            with self._lock:
                rec.provision_error = repr(err)
                if rec.destroyed_at is None:
                    rec.status, rec.exited_at = "exited", time.time()
                    rec.status_msg = f"stand-in could not start the container: {err}"

    def _provision_locked(self, inst: _Instance) -> None:
        rec = inst.rec
        private, public = _host_key()
        with self._lock:
            rec.host_public_key = public
        files: list[tuple[str, bytes | None, int]] = [
            ("root/.ssh", None, 0o700),
            ("root/.ssh/authorized_keys", "".join(k + "\n" for k in rec.ssh_keys).encode(), 0o600),
            (HOST_KEY.lstrip("/"), private, 0o600),
            (HOST_KEY.lstrip("/") + ".pub", public.encode() + b"\n", 0o644),
        ]
        if rec.onstart:
            files.append(("root/onstart.sh", rec.onstart.encode() + b"\n", 0o755))
        archive = _tar(files, {})
        mounts = [Mount(p, p, type="bind", read_only=True) for p in _host_mounts()]
        wanted = [22, *rec.requested_ports]
        last: Exception | None = None
        for _ in range(5):
            if rec.destroyed_at is not None or self._closing.is_set():
                return
            host_ports = _allocate_ports(len(wanted))
            mapping = dict(zip(wanted, host_ports, strict=True))
            try:
                self._start_container(inst, mapping, mounts, archive)
            except Exception as err:
                _release_ports(host_ports)
                with contextlib.suppress(DockerException):
                    self.docker.containers.get(rec.container_name).remove(force=True)
                text = str(err).lower()
                if "already allocated" in text or "address already in use" in text:
                    last = err
                    continue
                raise
            with self._lock:
                rec.ports = mapping
                inst.started = True
                inst.restarted_at = time.time()
                rec.status_msg = "Container started"
            return
        raise RuntimeError(f"no free ports after 5 tries: {last}")

    def _start_container(
        self, inst: _Instance, mapping: dict[int, int], mounts: list[Mount], archive: bytes
    ) -> None:
        rec = inst.rec
        env = dict(rec.env)
        env.update(
            {
                "CONTAINER_ID": str(rec.id),
                "CONTAINER_API_KEY": rec.container_api_key,
                "VAST_CONTAINERLABEL": f"C.{rec.id}",
                "PUBLIC_IPADDR": self.public_ip,
            }
        )
        env.update({f"VAST_TCP_PORT_{c}": str(h) for c, h in mapping.items()})
        with contextlib.suppress(NotFound):
            self.docker.containers.get(rec.container_name).remove(force=True)
        container = self.docker.containers.create(
            self.image,
            command=self._command(rec),
            name=rec.container_name,
            labels={LABEL: self.id, LABEL_INSTANCE: str(rec.id)},
            environment=env,
            mounts=mounts,
            network=self.network_name,
            ports={f"{c}/tcp": (self.public_ip, h) for c, h in mapping.items()},
            init=True,
            working_dir="/root",
            detach=True,
        )
        with self._lock:
            rec.container_id = container.id
        container.put_archive("/", archive)
        container.start()

    # ------------------------------------------------------------------ monitor
    def _monitor(self) -> None:
        while not self._closing.wait(self.poll_s):
            with self._lock:
                live = [
                    i for i in self._instances.values() if i.rec.destroyed_at is None and i.started
                ]
            for inst in live:
                with contextlib.suppress(Exception):
                    self._check(inst)

    def _check(self, inst: _Instance) -> None:
        rec = inst.rec
        if inst.intended != "running" or rec.status not in ("loading", "running"):
            return
        now = time.time()
        if now - rec.created_at < self.null_status_s:
            return
        # Under the instance's op lock: a start, stop or destroy in progress is not an exit.
        if rec.container_id is None or not inst.op_lock.acquire(blocking=False):
            return
        try:
            try:
                state = self.docker.api.inspect_container(rec.container_id)["State"]
            except NotFound:
                state = {"Running": False, "ExitCode": None, "Status": "removed"}
            with self._lock:
                if rec.destroyed_at is not None or inst.intended != "running":
                    return
                if not state.get("Running"):
                    rec.status, rec.exited_at = "exited", now
                    rec.exit_code = state.get("ExitCode")
                    rec.status_msg = (
                        f"container exited ({state.get('Status')}, code {rec.exit_code})"
                    )
                    return
                ready = rec.status == "loading" and rec.mode == "normal"
                ready = ready and now - inst.restarted_at >= self.min_loading_s
                port = rec.ports.get(22)
        finally:
            inst.op_lock.release()
        if ready and port and _banner(self.public_ip, port):
            with self._lock:
                live = rec.destroyed_at is None and inst.intended == "running"
                if live and rec.status == "loading":
                    rec.status = "running"
                    rec.running_at = rec.running_at or time.time()
                    rec.status_msg = "success, running"

    # ------------------------------------------------------------------ instances
    def _row(self, inst: _Instance) -> dict[str, Any]:
        rec, offer = inst.rec, inst.offer
        ports = rec.ports if inst.started else {}
        return {
            "id": rec.id,
            "label": rec.label,
            "actual_status": self._status(inst),
            "intended_status": inst.intended,
            "cur_state": inst.intended,
            "next_state": inst.intended,
            "status_msg": rec.status_msg,
            "image_uuid": rec.image,
            "image_runtype": rec.runtype,
            "onstart": rec.onstart,
            "public_ipaddr": self.public_ip,
            "ssh_host": self.public_ip,
            "ssh_port": ports.get(22),
            "ports": {
                f"{c}/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(h)}] for c, h in ports.items()
            },
            "machine_id": offer.get("machine_id"),
            "host_id": offer.get("host_id"),
            "bundle_id": offer.get("bundle_id"),
            "gpu_name": offer.get("gpu_name"),
            "num_gpus": offer.get("num_gpus"),
            "gpu_ram": offer.get("gpu_ram"),
            "cpu_cores": offer.get("cpu_cores"),
            "cpu_ram": offer.get("cpu_ram"),
            "dph_total": offer.get("dph_total"),
            "disk_space": rec.disk,
            "reliability2": offer.get("reliability2"),
            "geolocation": offer.get("geolocation"),
            "direct_port_count": offer.get("direct_port_count"),
            "start_date": rec.created_at,
            "end_date": None,
            "extra_env": [[k, v] for k, v in rec.env.items()],
        }

    def _list_v1(self, query: dict[str, str]) -> dict[str, Any]:
        def arg(name: str, default: Any) -> Any:
            if name not in query:
                return default
            try:
                return json.loads(query[name])
            except ValueError:
                raise _error(400, "invalid_args", f"{name} is not JSON") from None

        filters = arg("select_filters", {}) or {}
        order_by = arg("order_by", [{"col": "id", "dir": "asc"}]) or []
        limit = arg("limit", 25)
        if not isinstance(filters, dict):
            raise _error(400, "invalid_args", "select_filters must be an object")
        if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit <= 1000:
            raise _error(400, "invalid_args", f"bad limit {limit!r}")
        order: list[tuple[str, bool]] = []
        for item in order_by if isinstance(order_by, list) else [order_by]:
            if isinstance(item, dict) and "col" in item:
                order.append((str(item["col"]), str(item.get("dir", "asc")).lower() == "desc"))
            elif isinstance(item, list | tuple) and item:
                order.append((str(item[0]), len(item) > 1 and str(item[1]).lower() == "desc"))
            else:
                raise _error(400, "invalid_args", f"bad order_by entry {item!r}")
        if self._take("list_without_instances_key"):
            return {"next_token": None}
        with self._lock:
            rows = [self._row(i) for i in self._instances.values() if i.rec.destroyed_at is None]
        rows = [r for r in rows if matches(r, filters)]
        rows, key, desc = _sorted(rows, order)
        total = len(rows)
        token = query.get("after_token")
        if token:
            try:
                after = json.loads(base64.urlsafe_b64decode(token.encode()))["after"]
            except (ValueError, KeyError, TypeError, binascii.Error):
                raise _error(400, "invalid_args", "bad after_token") from None
            rows = [r for r in rows if _cmp_keys(key(r), after, desc) > 0]
        page = rows[:limit]
        next_token = None
        if len(rows) > limit:
            blob = json.dumps({"after": key(page[-1])}).encode()
            next_token = base64.urlsafe_b64encode(blob).decode()
        counts: dict[str, int] = {}
        for r in page:
            counts[str(r["label"])] = counts.get(str(r["label"]), 0) + 1
        return {
            "instances": page,
            "next_token": next_token,
            "total_instances": total,
            "label_counts": counts,
        }

    def _live(self, iid: int) -> _Instance:
        inst = self._instances.get(iid)
        if inst is None or inst.rec.destroyed_at is not None:
            raise _error(404, "no_such_instance", f"Instance {iid} not found.")
        return inst

    def _destroy(self, iid: int, sync: bool) -> Callable[[], None] | None:
        with self._lock:
            inst = self._live(iid)
            inst.rec.destroyed_at = time.time()
            inst.rec.status_msg = "destroyed"
            if inst.offer["id"] not in self._vanished:
                inst.offer["rented"] = False

        def remove() -> None:
            with inst.op_lock:
                cid = inst.rec.container_id
                if cid is not None:
                    with contextlib.suppress(NotFound):
                        self.docker.api.remove_container(cid, force=True)
                _release_ports(list(inst.rec.ports.values()))

        if sync:
            remove()
            return None
        return remove

    def _put_instance(self, iid: int, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise _error(400, "invalid_args", "the request needs a JSON object")
        with self._lock:
            inst = self._live(iid)
        state = body.get("state")
        if state not in (None, "stopped", "running"):
            raise _error(400, "invalid_args", f"bad state {state!r}")
        with inst.op_lock:  # the monitor must not see a stop or a start half done
            with self._lock:
                inst = self._live(iid)
                if "label" in body:
                    inst.rec.label = None if body["label"] is None else str(body["label"])
                if state is None:
                    return {"success": True}
                inst.intended = str(state)
                if state == "stopped":
                    inst.rec.stop_calls += 1
                    inst.rec.stopped_at = time.time()
                    inst.rec.status, inst.rec.status_msg = "stopped", "stopped by request"
                else:
                    inst.rec.status, inst.rec.status_msg = "loading", "starting"
                    inst.restarted_at = time.time()
                cid = inst.rec.container_id
            if cid is not None:
                if state == "stopped":
                    self.docker.api.stop(cid, timeout=2)
                else:
                    self.docker.api.start(cid)
        return {"success": True}


def start_standin(
    docker_client: docker.DockerClient,
    api_key: str | None = None,
    offers: list[dict[str, Any]] | None = None,
    **options: Any,
) -> VastStandin:
    """A running stand-in on ``docker_client``'s daemon; ``close()`` it (see
    :func:`vast_standin`). Options: null_status_s, min_loading_s, exit_after_s, poll_s."""
    return VastStandin(docker_client, api_key, offers, **options)


@contextlib.contextmanager
def vast_standin(
    docker_client: docker.DockerClient,
    api_key: str | None = None,
    offers: list[dict[str, Any]] | None = None,
    **options: Any,
) -> Iterator[VastStandin]:
    standin = start_standin(docker_client, api_key, offers, **options)
    try:
        yield standin
    finally:
        standin.close()


__all__ = [
    "InstanceRecord",
    "Switches",
    "VastStandin",
    "default_offers",
    "matches",
    "start_standin",
    "vast_standin",
]
