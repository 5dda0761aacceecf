"""The Docker provider: each node a container on its run's own Docker network.

Everything it makes carries labels (created-by, run id, node id, nonce, run workflow id,
resource name), so a retried start, teardown and the reaper find it by what the daemon
reports, not by our records. A run's containers share one user-defined bridge network,
``mvp-orchestrator-<run_id>-<nonce8>``: each node has its own address there, binds its
data-plane listener on it and advertises it; a container of another run's network cannot
reach it (the daemon isolates bridge networks) and could not authenticate if it did.

Start is idempotent at its source: a container of the same execution is reused (started
if a killed attempt only created it), one of an older execution of the run is removed.
Stop is stop-then-remove; "not found" and "removal already in progress" are success.

Images: ``worker_image`` when the run names one (docker/Dockerfile builds it for real
deployments); else the *host image*, which the provider makes itself, offline, the first
time a run needs it: a skeleton root filesystem imported with ``docker import`` that runs
this host's Python, virtual environment and package, bind-mounted read-only. Its labels
say which host paths it mounts and which interpreter it runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import socket
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import docker
import requests
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.models.containers import Container
from docker.models.networks import Network
from docker.types import DeviceRequest, LogConfig, Mount

from activities.providers.base import (
    NODE_STDERR_FILE,
    NodeStartFailed,
    Progress,
    ProviderUnavailable,
    deployment_id,
    harness_crash,
    last_log_line,
    node_environment,
    node_exited,
    state_dir,
)
from mvp_core import names
from mvp_core.models import (
    NodeExited,
    NodeHandle,
    NodeProvisionSpec,
    ProviderKind,
    ProviderResource,
    StopNodeResult,
)
from mvp_core.names import NODE_MODULE, resource_arg
from mvp_io.kernel_dirs import PREBUILT_ENV, kernel_dir
from temporal.connect import temporal_address

CREATED_BY = "mvp-orchestrator"
LABEL_CREATED_BY = "mvp.created-by"
LABEL_RUN_ID = "mvp.run-id"
LABEL_NODE_ID = "mvp.node-id"
LABEL_NONCE = "mvp.nonce"
LABEL_RUN_WORKFLOW_ID = "mvp.run-workflow-id"
LABEL_RESOURCE = "mvp.resource"
LABEL_HOST = "mvp.provider-host"
LABEL_DEPLOYMENT = "mvp.deployment"  # the state directory's deployment id (base.py)
# Labels of the host image: the host paths it needs mounted, and its interpreter.
LABEL_HOST_MOUNTS = "mvp.host-mounts"
LABEL_PYTHON = "mvp.python"

HOST_IMAGE_REPO = "mvp-orchestrator-node"
HOST_IMAGE_FORMAT = 2  # bump when _skeleton_rootfs changes: the tag then changes too
NODE_DIR_IN_CONTAINER = "/var/lib/mvp/node"
TEMPORAL_ADDRESS_ENV = "MVP_DOCKER_TEMPORAL_ADDRESS"  # where containers reach Temporal
_PASS_ENV = ("LANG", "LC_ALL", "MVP_SWITCH_INTERVAL")
_GONE = ("exited", "dead")
_Filters = dict[str, str | list[str] | bool]
# What a daemon that stopped answering raises: docker-py's errors, and requests' own
# (a connection refused on a cached client).
_DOCKER_ERRORS: tuple[type[Exception], ...] = (DockerException, requests.RequestException)
_PUMP_ERRORS: tuple[type[Exception], ...] = (*_DOCKER_ERRORS, OSError)


def container_name(run_id: int, node_id: int, nonce: str) -> str:
    """CONTRACTS' ``mvp-orchestrator-<run_id>-<node_id>`` plus the execution's nonce
    (DECISIONS 82: a conflict adopts the container of this execution only)."""
    return f"mvp-orchestrator-{run_id}-{node_id}-{nonce[:8]}"


def network_name(run_id: int, nonce: str) -> str:
    return f"mvp-orchestrator-{run_id}-{nonce[:8]}"


def device_requests(gpus: str | None) -> list[DeviceRequest]:
    """``[docker].gpus`` as device requests: 'all', a count, or device ids."""
    if not gpus:
        return []
    if gpus == "all":
        return [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    if gpus.isdigit():
        return [DeviceRequest(count=int(gpus), capabilities=[["gpu"]])]
    return [DeviceRequest(device_ids=gpus.split(","), capabilities=[["gpu"]])]


def _daemon_address() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def _explain(err: Exception) -> str:
    text = getattr(err, "explanation", None) or str(err)
    return str(text).strip()[:500]


class LogPump:
    """A node container's output, written as it runs: stdout to ``node.log``, stderr to
    ``node.err`` in the node's directory on this host (as the process provider's nodes
    write theirs), so the run's datastream, the dashboard and fault texts see it live and
    apart. One thread per stream follows the daemon's log API from the container's start
    (the files are rewritten from the start by a pump of a later worker) and ends when the
    container stops or goes."""

    def __init__(self, client: docker.DockerClient, container_id: str, node_dir: Path) -> None:
        node_dir.mkdir(parents=True, exist_ok=True)
        self.threads = [
            threading.Thread(
                target=self._pump,
                args=(client, container_id, node_dir / name, which),
                name=f"docker-logs-{container_id[:12]}-{which}",
                daemon=True,
            )
            for name, which in (("node.log", "stdout"), (NODE_STDERR_FILE, "stderr"))
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _pump(client: docker.DockerClient, container_id: str, path: Path, which: str) -> None:
        try:
            chunks = client.api.logs(
                container_id,
                stdout=which == "stdout",
                stderr=which == "stderr",
                stream=True,
                follow=True,
            )
            with open(path, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    out.flush()
        except _PUMP_ERRORS:
            return  # the container went, or the daemon: what was written stays

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout_s: float) -> bool:
        """Wait (bounded) for both streams to end; whether they did."""
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not self.alive()


class DockerProvider:
    def __init__(self, *, host: str | None = None) -> None:
        self.host = host or socket.gethostname()
        self.deployment = deployment_id()
        self._client: docker.DockerClient | None = None
        self._pumps: dict[str, LogPump] = {}  # by resource name: this worker's
        self._pumps_lock = threading.Lock()

    # ------------------------------------------------------------------ daemon
    def client(self) -> docker.DockerClient:
        """The daemon client (``DOCKER_HOST`` respected); ProviderUnavailable without one."""
        if self._client is not None:
            return self._client
        try:
            client = docker.from_env(timeout=60)
            client.ping()
        except _DOCKER_ERRORS as err:
            raise ProviderUnavailable(
                f"no Docker daemon reachable at {_daemon_address()} ({_explain(err)}); "
                "start dockerd or set DOCKER_HOST"
            ) from None
        self._client = client
        return client

    def check(self, spec_gpus: str | None) -> None:
        client = self.client()
        try:
            client.ping()
        except _DOCKER_ERRORS as err:
            self._client = None
            raise ProviderUnavailable(
                f"the Docker daemon at {_daemon_address()} stopped answering: {_explain(err)}"
            ) from None

    # ------------------------------------------------------------------ images
    def host_image(self) -> tuple[str, list[str], str]:
        """The offline host image (made on first use): tag, host mounts, interpreter."""
        python = sys.executable
        source_root = str(Path(__file__).resolve().parents[2])
        mounts = sorted(
            {"/usr", os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), source_root}
        )
        mounts = [m for m in mounts if not any(m.startswith(o + "/") for o in mounts if o != m)]
        digest = hashlib.sha256(
            json.dumps([HOST_IMAGE_FORMAT, python, mounts]).encode()
        ).hexdigest()[:12]
        tag = f"{HOST_IMAGE_REPO}:host-{digest}"
        client = self.client()
        try:
            client.images.get(tag)
        except ImageNotFound:
            changes = [
                f"LABEL {LABEL_CREATED_BY}={CREATED_BY}",
                f"LABEL {LABEL_HOST_MOUNTS}={json.dumps(mounts, separators=(',', ':'))}",
                f"LABEL {LABEL_PYTHON}={python}",
                f"WORKDIR {NODE_DIR_IN_CONTAINER}",
            ]
            client.api.import_image_from_data(
                _skeleton_rootfs(),
                repository=HOST_IMAGE_REPO,
                tag=tag.split(":")[1],
                changes=changes,
            )
        return tag, mounts, python

    def _image(self, ref: str | None) -> tuple[str, list[str], str]:
        """The image a node runs, the host paths it needs and its interpreter."""
        if not ref:
            return self.host_image()
        client = self.client()
        try:
            image = client.images.get(ref)
        except ImageNotFound:
            try:
                image = client.images.pull(ref)
            except DockerException as err:
                raise NodeStartFailed(
                    f"worker image {ref!r} is not on this host and could not be pulled: "
                    f"{_explain(err)}"
                ) from None
        labels = image.labels or {}
        mounts = json.loads(labels.get(LABEL_HOST_MOUNTS, "[]"))
        return ref, [str(m) for m in mounts], labels.get(LABEL_PYTHON, "python")

    # ------------------------------------------------------------------ networks
    def _network(self, spec: NodeProvisionSpec) -> Network:
        """The run's network, made on first use (idempotent)."""
        client = self.client()
        name = network_name(spec.run_id, spec.nonce)
        found = client.networks.list(names=[name], filters={"label": self._ours()})
        found = [n for n in found if n.name == name]
        if found:
            net = found[0]
        else:
            try:
                net = client.networks.create(
                    name,
                    driver="bridge",
                    check_duplicate=True,
                    labels=self._labels(spec, resource=name),
                )
            except APIError as err:
                if err.status_code != 409:
                    raise
                net = client.networks.get(name)
        net.reload()
        return net

    def _temporal_address(self, net: Network) -> str:
        """Where nodes on ``net`` reach Temporal: ``MVP_DOCKER_TEMPORAL_ADDRESS``, else
        the worker's own address (``TEMPORAL_ADDRESS`` or its profile's), with a loopback
        host replaced by the network's gateway (the host itself, seen from the
        containers). Checked from this host first."""
        configured = os.environ.get(TEMPORAL_ADDRESS_ENV)
        if configured:
            return configured
        address = temporal_address()
        host, _, port = address.rpartition(":")
        if host not in ("localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0"):
            return address
        try:
            gateway = str(net.attrs["IPAM"]["Config"][0]["Gateway"])
        except (KeyError, IndexError, TypeError):
            raise NodeStartFailed(f"network {net.name} has no gateway address") from None
        try:
            with socket.create_connection((gateway, int(port)), timeout=2):
                pass
        except OSError:
            raise NodeStartFailed(
                f"Temporal at {address} is not reachable from containers at {gateway}:{port}: "
                "let the server listen on all addresses (temporal server start-dev --ip "
                f"0.0.0.0; temporal/dev-server does with MVP_TEMPORAL_IP=0.0.0.0) or set "
                f"{TEMPORAL_ADDRESS_ENV}"
            ) from None
        return f"{gateway}:{port}"

    def _remove_network_if_unused(self, run_id: int, nonce8: str) -> None:
        client = self.client()
        if self._containers(f"{LABEL_RUN_ID}={run_id}", f"{LABEL_NONCE}={nonce8}"):
            return
        for net in client.networks.list(
            names=[network_name(run_id, nonce8)], filters={"label": self._ours()}
        ):
            with contextlib.suppress(NotFound, APIError):
                net.remove()

    # ------------------------------------------------------------------ labels
    def _labels(
        self, spec: NodeProvisionSpec, *, resource: str, node: bool = False
    ) -> dict[str, str]:
        labels = {
            LABEL_CREATED_BY: CREATED_BY,
            LABEL_DEPLOYMENT: self.deployment,
            LABEL_RUN_ID: str(spec.run_id),
            LABEL_NONCE: spec.nonce[:8],
            LABEL_RUN_WORKFLOW_ID: spec.run_workflow_id,
            LABEL_RESOURCE: resource,
            LABEL_HOST: self.host,
        }
        if node:
            labels[LABEL_NODE_ID] = str(spec.node_id)
        return labels

    def _ours(self) -> list[str]:
        """Label filters of this deployment's resources (never another's on the daemon)."""
        return [f"{LABEL_CREATED_BY}={CREATED_BY}", f"{LABEL_DEPLOYMENT}={self.deployment}"]

    def _containers(self, *labels: str) -> list[Container]:
        filters: _Filters = {"label": [*self._ours(), *labels]}
        # ignore_removed: one removed between the list and its inspect (a concurrent
        # stop) is gone, not an error.
        return list(self.client().containers.list(all=True, filters=filters, ignore_removed=True))

    # ------------------------------------------------------------------ start
    def start(self, spec: NodeProvisionSpec, progress: Progress | None = None) -> NodeHandle:
        resource = names.node_resource_name(spec.run_id, spec.node_id, spec.nonce)
        existing: Container | None = None
        for c in self._containers(
            f"{LABEL_RUN_ID}={spec.run_id}", f"{LABEL_NODE_ID}={spec.node_id}"
        ):
            if c.labels.get(LABEL_NONCE) == spec.nonce[:8]:
                existing = c  # this execution's: made by an attempt that died
            else:
                self._remove(c, grace_s=2)  # a stale node of an older execution
        net = self._network(spec)
        if existing is None:
            existing = self._create(spec, resource, net)
        if existing.status == "created":
            try:
                existing.start()
            except APIError as err:
                self._remove(existing, grace_s=0)
                self._remove_network_if_unused(spec.run_id, spec.nonce[:8])
                raise NodeStartFailed(self._start_error(spec, err)) from None
        existing.reload()
        self._pump_logs(existing, resource)
        address = existing.attrs["NetworkSettings"]["Networks"].get(net.name, {}).get("IPAddress")
        return NodeHandle(
            run_id=spec.run_id,
            node_id=spec.node_id,
            provider=ProviderKind.DOCKER,
            host=self.host,
            log_path=str(self._node_dir(resource) / "node.log"),
            resource_name=resource,
            container_id=existing.id,
            address=address or None,
        )

    def _create(self, spec: NodeProvisionSpec, resource: str, net: Network) -> Container:
        name = container_name(spec.run_id, spec.node_id, spec.nonce)
        image, image_mounts, python = self._image(spec.image_or_artifact)
        mounts = [Mount(p, p, type="bind", read_only=True) for p in image_mounts]
        covered = [m["Target"] for m in mounts]
        for path in spec.mounts:  # the model (and tokenizer): read-only, at the same path
            real = os.path.realpath(path)
            if not any(path == c or path.startswith(c + "/") for c in covered):
                mounts.append(Mount(path, real, type="bind", read_only=True))
                covered.append(path)
        # The host's builds of the engine's kernel, read-only: a node loads the one of
        # its source instead of compiling it at every container start (DECISIONS 87).
        kernels = kernel_dir()
        prebuilt = {}
        if kernels.is_dir() and not any(str(kernels).startswith(c + "/") for c in covered):
            mounts.append(
                Mount(str(kernels), os.path.realpath(kernels), type="bind", read_only=True)
            )
            prebuilt = {PREBUILT_ENV: str(kernels)}
        host_env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
        host_env.update(prebuilt)
        host_env.update(
            {
                "MVP_DATAPLANE_HOST": "0.0.0.0",
                "PYTHONUNBUFFERED": "1",
                "OMP_WAIT_POLICY": "PASSIVE",
                "HOME": "/root",
                # A container's writable layer is thrown away with it, and the pages it
                # writes count against its memory limit: no layout cache there (a host
                # directory mounted for it is the way to one).
                "MVP_LAYOUT_CACHE": "off",
            }
        )
        # Certificates travel inline: the container does not see this host's files.
        env = node_environment(
            spec,
            NODE_DIR_IN_CONTAINER,
            host_env=host_env,
            temporal_address=self._temporal_address(net),
            inline_files=True,
        )
        try:
            container = self.client().containers.create(
                image,
                command=[python, "-m", NODE_MODULE, resource_arg(resource)],
                name=name,
                hostname=name,
                labels=self._labels(spec, resource=resource, node=True),
                environment=env,
                mounts=mounts,
                network=net.name,
                init=True,  # PID 1 forwards SIGTERM and reaps
                # The token path runs at nice -5 where it may (CONTRACTS engine settings).
                cap_add=["SYS_NICE"],
                working_dir=NODE_DIR_IN_CONTAINER,
                device_requests=device_requests(spec.gpus),
                nano_cpus=None if spec.cpus is None else max(1, round(spec.cpus * 1e9)),
                # A node that held more than its planned share is killed, not swapped.
                mem_limit=spec.memory,
                memswap_limit=spec.memory,
                log_config=LogConfig(type="json-file", config={"max-size": "20m", "max-file": "2"}),
                detach=True,
            )
        except APIError as err:
            if err.status_code == 409:  # a concurrent attempt made it: the same execution's
                return self.client().containers.get(name)
            raise NodeStartFailed(f"docker could not create {name}: {_explain(err)}") from None
        harness_crash("created")  # the worker dies between create and start
        return container

    @staticmethod
    def _start_error(spec: NodeProvisionSpec, err: APIError) -> str:
        name = container_name(spec.run_id, spec.node_id, spec.nonce)
        why = _explain(err)
        if spec.gpus and ("device driver" in why or "gpu" in why.lower()):
            return (
                f"docker could not start {name} with gpus={spec.gpus!r}: {why} (this host has "
                "no GPU driver for Docker, e.g. the NVIDIA container toolkit; run without "
                "docker.gpus); the container was removed"
            )
        return f"docker could not start {name}: {why}; the container was removed"

    # ------------------------------------------------------------------ stop
    def _node_dir(self, resource: str) -> Path:
        return state_dir() / "nodes" / resource

    def _find(self, handle: NodeHandle) -> list[Container]:
        return self._containers(f"{LABEL_RESOURCE}={handle.resource_name}")

    def _pump_logs(self, container: Container, resource: str) -> None:
        """Write the container's output to its node directory as it runs (``LogPump``);
        one pump per container in this worker."""
        with self._pumps_lock:
            pump = self._pumps.get(resource)
            if pump is not None and pump.alive():
                return
            for name in [r for r, p in self._pumps.items() if not p.alive()]:
                del self._pumps[name]
            self._pumps[resource] = LogPump(
                self.client(), str(container.id), self._node_dir(resource)
            )

    def _save_logs(self, container: Container) -> None:
        """Once the container stopped: its output complete in ``node.log`` and
        ``node.err``. A pump of this worker has it (its streams end with the container);
        without one (a worker that did not start it) the daemon's copy is written."""
        resource = container.labels.get(LABEL_RESOURCE, "")
        if names.parse_resource_name(resource) is None:
            return  # a label we did not write: never a path of its choosing
        with self._pumps_lock:
            pump = self._pumps.pop(resource, None)
        if pump is not None and pump.join(5.0):
            return
        node_dir = self._node_dir(resource)
        node_dir.mkdir(parents=True, exist_ok=True)
        for name, stdout in (("node.log", True), (NODE_STDERR_FILE, False)):
            try:
                logs = container.logs(stdout=stdout, stderr=not stdout)
            except _DOCKER_ERRORS:
                return
            tmp = node_dir / (name + ".tmp")
            tmp.write_bytes(logs)
            os.replace(tmp, node_dir / name)

    def _remove(self, container: Container, grace_s: float) -> None:
        """Stop (SIGTERM, then SIGKILL after ``grace_s``) and remove; gone is success."""
        try:
            if container.status not in _GONE and container.status != "created":
                container.stop(timeout=max(int(grace_s + 0.999), 0))
            self._save_logs(container)
            container.remove(force=True)
        except NotFound:
            return
        except APIError as err:
            if err.status_code == 409 and "in progress" in _explain(err):
                return  # another stop is removing it
            raise

    def complete_bootstrap(self, handle: NodeHandle) -> None:
        """Nothing it can undo: the node's environment is its container's configuration,
        which the daemon keeps (for those who may use the daemon) while the container
        lives."""

    def stop(self, handle: NodeHandle, grace_s: float) -> StopNodeResult:
        try:
            found = self._find(handle)
            for c in found:
                self._remove(c, grace_s)
            nonce8 = handle.resource_name.rsplit("-", 1)[-1]
            self._remove_network_if_unused(handle.run_id, nonce8)
        except NotFound:
            pass  # removed by a concurrent stop (or the reaper): stopped
        except _DOCKER_ERRORS as err:
            return StopNodeResult(
                node_id=handle.node_id, stopped=False, error=f"docker: {_explain(err)}"
            )
        return StopNodeResult(node_id=handle.node_id, stopped=True)

    def poll_exited(self, handles: list[NodeHandle]) -> NodeExited | None:
        for handle in handles:
            try:
                found = self._find(handle)
            except _DOCKER_ERRORS:
                return None  # the daemon blinked: not evidence that a node is gone
            if not found:
                return node_exited(handle, f"container of {handle.resource_name} is gone")
            c = found[0]
            if c.status in _GONE:
                state: dict[str, Any] = c.attrs.get("State", {})
                code = state.get("ExitCode")
                oom = " (out of memory)" if state.get("OOMKilled") else ""
                return node_exited(
                    handle, f"container {c.name} exited with code {code}{oom}{self._tail(c)}"
                )
        return None

    @staticmethod
    def _tail(container: Container) -> str:
        try:
            return last_log_line(container.logs(tail=3).decode(errors="replace"))
        except _DOCKER_ERRORS:
            return ""

    # ------------------------------------------------------------------ the reaper's sweep
    def list_resources(self) -> list[ProviderResource]:
        """Containers first, then networks: a network goes once its containers are gone."""
        client = self.client()
        label: _Filters = {"label": self._ours()}
        found: list[ProviderResource] = []
        for c in client.containers.list(all=True, filters=label, ignore_removed=True):
            found.append(self._resource(c.labels, "container", str(c.name), c.status))
        for n in client.networks.list(filters=label):
            found.append(self._resource(n.attrs.get("Labels") or {}, "network", str(n.name), ""))
        return found

    def _resource(
        self, labels: dict[str, str], kind: str, name: str, detail: str
    ) -> ProviderResource:
        return ProviderResource(
            provider=ProviderKind.DOCKER,
            kind="container" if kind == "container" else "network",
            name=name,
            run_workflow_id=labels.get(LABEL_RUN_WORKFLOW_ID, ""),
            nonce8=labels.get(LABEL_NONCE, ""),
            host=labels.get(LABEL_HOST, self.host),
            detail=detail,
        )

    def destroy(self, resource: ProviderResource) -> None:
        client = self.client()
        try:
            if resource.kind == "container":
                c = client.containers.get(resource.name)
                if c.labels.get(LABEL_DEPLOYMENT) == self.deployment:
                    self._remove(c, grace_s=5)
            elif resource.kind == "network":
                net = client.networks.get(resource.name)
                net.reload()
                for cid in net.attrs.get("Containers") or {}:
                    with contextlib.suppress(NotFound):
                        self._remove(client.containers.get(cid), grace_s=5)
                net.remove()
        except NotFound:
            return


def _skeleton_rootfs() -> bytes:
    """A root filesystem with nothing of its own: /usr, the Python and the package come
    from the host, bind-mounted read-only (the image's ``mvp.host-mounts`` label)."""
    buf = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add_dir(path: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(path)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, now
            tar.addfile(info)

        def add_link(path: str, target: str) -> None:
            info = tarfile.TarInfo(path)
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, now
            tar.addfile(info)

        def add_file(path: str, data: bytes, mode: int = 0o644) -> None:
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), mode, now
            tar.addfile(info, io.BytesIO(data))

        # /sbin is a directory of its own: the daemon mounts its init there.
        for d in ("usr", "etc", "root", "proc", "sys", "dev", "run", "var", "var/lib", "sbin"):
            add_dir(d)
        add_dir("var/lib/mvp")
        add_dir("var/lib/mvp/node")
        add_dir("tmp", 0o1777)
        for link in ("bin", "lib", "lib64"):
            add_link(link, f"usr/{link}")
        add_file(
            "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"
        )
        add_file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
        add_file("etc/nsswitch.conf", b"passwd: files\ngroup: files\nhosts: files dns\n")
        with contextlib.suppress(OSError):
            add_file("etc/ld.so.cache", Path("/etc/ld.so.cache").read_bytes())
    return buf.getvalue()
