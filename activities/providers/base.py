"""The provider interface: one class per kind (process, docker, vastai), and the facts
every provider puts into a node's environment the same way."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from mvp_core.datastream import Redactor
from mvp_core.edge_auth import (
    EDGE_SECRET_FILE,
    TEXT_TOKEN_ENV,
    EdgeSecretError,
    configured_secret,
    text_stream_token,
)
from mvp_core.edge_auth import edge_token as edge_token  # re-exported: the providers' own
from mvp_core.edge_auth import state_dir as state_dir
from mvp_core.models import (
    NodeExited,
    NodeHandle,
    NodeProvisionSpec,
    ProviderResource,
    StopNodeResult,
)
from temporal import telemetry
from temporal.connect import TemporalSettings

# Secrets a provider passes from its own environment into node environments: only those a
# node uses. A node encrypts its payloads (MVP_PAYLOAD_KEY) and never downloads from the
# hub itself (its host fetches its share before it starts, DECISIONS 72), so HF_TOKEN stays
# with the orchestrator worker (a Vast.ai instance's fetch gets it on stdin, for that one
# process), as do the provider's own credentials (VASTAI_API_KEY). They never
# travel in workflow or activity payloads (docs/architecture.md "Secrets"). The Temporal
# API key (and TLS client key data, gRPC metadata) travels the same way, with the rest of
# the connection settings: temporal_env below.
SECRET_ENV_PASSTHROUGH = ("MVP_PAYLOAD_KEY",)

# The edge token (docs/decisions.md 32): derived on the provider's host from a secret that
# never enters Temporal, and handed to the node in its environment only.
EDGE_TOKEN_ENV = "MVP_EDGE_TOKEN"

# Test-only fault injection (docs/decisions.md 31): a provider hands MVP_FAULT_* knobs to
# its nodes only when the orchestrator worker itself was started by a test harness with
# MVP_TEST_FAULTS_FILE (a JSON object: run id -> {knob: value}); nodes honour them only
# with MVP_TEST_FAULTS_ALLOWED=1 in their own environment, which only such a provider sets.
TEST_FAULTS_FILE_ENV = "MVP_TEST_FAULTS_FILE"
TEST_FAULTS_ALLOWED_ENV = "MVP_TEST_FAULTS_ALLOWED"
FAULT_PREFIX = "MVP_FAULT_"

NODE_STDERR_FILE = "node.err"  # a process node's stderr, beside its node.log (stdout)
LOG_LINE_MAX = 200  # characters of a node's last log line in a fault text
_TAIL_BYTES = 8192  # how much of a node's log is read to find its last line


class ProviderUnavailable(RuntimeError):
    """The provider cannot serve runs on this host (no daemon, no credentials); the
    message names what is missing. A run asking for it is rejected before provisioning."""


class NodeStartFailed(RuntimeError):
    """A node could not be started, and retrying will not help (a GPU request on a host
    without a GPU driver, an image that does not exist); nothing of it was left behind."""


# What a start tells of a share fetched on the node's own host: (bytes held, bytes in all).
Progress = Callable[[int, int], None]


class Provider(Protocol):
    def check(self, spec_gpus: str | None) -> None:
        """Raise ProviderUnavailable unless this host can start nodes with these settings
        (process spec 9.2: checked before any node starts)."""
        ...

    def list_resources(self) -> list[ProviderResource]:
        """Every labelled resource of this provider on this host, live or not, as the
        provider itself reports them (the reaper's sweep)."""
        ...

    def destroy(self, resource: ProviderResource) -> None:
        """Remove one resource; idempotent, "not found" is success."""
        ...

    def start(self, spec: NodeProvisionSpec, progress: Progress | None = None) -> NodeHandle:
        """Start a node; idempotent per (run_id, node_id, nonce). A provider whose node
        fetches its model share itself (Vast.ai) tells ``progress`` (bytes held, bytes in
        all) as that fetch goes."""
        ...

    def complete_bootstrap(self, handle: NodeHandle) -> None:
        """The node's runtime-ready acknowledgement succeeded (process spec 7.6): undo
        what only its start needed. Idempotent; raises (any error) where it could not."""
        ...

    def stop(self, handle: NodeHandle, grace_s: float) -> StopNodeResult:
        """Stop a node; idempotent, "not found" is success."""
        ...

    def poll_exited(self, handles: list[NodeHandle]) -> NodeExited | None:
        """Report the first node whose runtime is gone, if any."""
        ...


def node_exited(handle: NodeHandle, detail: str) -> NodeExited:
    """The report that ``handle``'s node is gone; ``detail`` says how (its fault text)."""
    return NodeExited(run_id=handle.run_id, node_id=handle.node_id, detail=detail)


def edge_secret() -> bytes:
    """The secret edge tokens are derived from: ``MVP_EDGE_SECRET`` (base64, to share it
    between the hosts whose providers start nodes of one run), else a random per-host
    secret kept in the state directory (mode 0600), made on first use."""
    try:
        configured = configured_secret()
    except EdgeSecretError as err:
        raise ValueError(str(err)) from None
    if configured is not None:
        return configured
    return _made_once(EDGE_SECRET_FILE, lambda: secrets.token_bytes(32), 0o600)


def deployment_id() -> str:
    """This state directory's deployment: a random id made on first use. Providers whose
    resources live in a shared place (a Docker daemon) label theirs with it, so that two
    deployments on one daemon never sweep or replace each other's."""
    made = _made_once("deployment-id", lambda: secrets.token_hex(8).encode(), 0o644)
    return made.decode().strip()


def temporal_scope(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The deployment this worker works for, where its resources share a place with other
    deployments' (one host's state directory, which every deployment of a user shares by
    default): the Temporal server and namespace of its connection settings, (address,
    namespace). Its reaper judges runs by that server and namespace alone, so it sweeps
    only what was made for them (DECISIONS 97)."""
    settings = TemporalSettings.load(environ)
    return settings.address.strip().lower(), settings.namespace


def _made_once(name: str, make: Callable[[], bytes], mode: int) -> bytes:
    """The content of ``name`` in the state directory, made by ``make`` on first use. Two
    workers of one host that race to make it agree on the first one written."""
    path = state_dir() / name
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = make()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        return path.read_bytes()  # another worker of this host made it first
    with os.fdopen(fd, "wb") as f:
        f.write(fresh)
    return fresh


def harness_crash(point: str) -> None:
    """Test harness only: the worker dies here when its harness set
    ``MVP_TEST_CRASH_AFTER_LAUNCH=<point>`` (the crash-between-launch-and-record tests)."""
    if (
        os.environ.get(TEST_FAULTS_FILE_ENV)
        and os.environ.get("MVP_TEST_CRASH_AFTER_LAUNCH") == point
    ):
        os._exit(1)


def harness_faults(run_id: int) -> dict[str, str]:
    """The test harness's fault knobs for ``run_id`` ({} outside a test harness)."""
    path = os.environ.get(TEST_FAULTS_FILE_ENV)
    if not path:
        return {}
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    knobs = table.get(str(run_id), {}) if isinstance(table, dict) else {}
    faults = {str(k): str(v) for k, v in knobs.items() if str(k).startswith(FAULT_PREFIX)}
    return {**faults, TEST_FAULTS_ALLOWED_ENV: "1"}


def temporal_env(address: str | None = None, *, inline_files: bool = False) -> dict[str, str]:
    """How a node connects to Temporal: the orchestrator worker's own connection settings
    (envconfig: its environment and profile, docs/temporal-connection.md) as environment
    variables, through ``address`` when the node reaches Temporal elsewhere (a Docker
    network's gateway, a tunnel's end). ``inline_files``: certificate and key contents
    instead of this host's paths, for nodes that do not see this host's files. The API
    key goes here and nowhere else: never into a payload."""
    return TemporalSettings.load().node_env(address, inline_files=inline_files)


def node_environment(
    spec: NodeProvisionSpec,
    node_dir: str,
    host_env: Mapping[str, str] | None = None,
    *,
    temporal_address: str | None = None,
    inline_files: bool = False,
    shared_address: bool = False,
) -> dict[str, str]:
    """A node's environment, in rising precedence: the run's ``node_env`` (reserved keys
    dropped again, whatever validation let through), the provider host's own environment
    ``host_env`` (PATH, the venv) and telemetry settings (``OTEL_*``; nodes that share the
    host's address, ``shared_address``, take a free Prometheus port each), the Temporal
    connection (:func:`temporal_env`),
    secrets, test faults, and the provider's facts about the node."""
    env = {
        k: v
        for k, v in spec.environment.items()
        if not (
            k.startswith(FAULT_PREFIX)
            or k.startswith("MVP_TEST_")
            or k.startswith("TEMPORAL_")
            or k in (EDGE_TOKEN_ENV, TEXT_TOKEN_ENV)
        )
    }
    env.update({k: v for k, v in (host_env or {}).items() if not k.startswith("TEMPORAL_")})
    env.update(telemetry.node_env(os.environ, own_port=shared_address))
    env.update(temporal_env(temporal_address, inline_files=inline_files))
    env.update({k: os.environ[k] for k in SECRET_ENV_PASSTHROUGH if k in os.environ})
    env.update(harness_faults(spec.run_id))
    secret = edge_secret()  # read once per node (a chaos cell holds starts on this read)
    env.update(
        {
            "MVP_RUN_ID": str(spec.run_id),
            "MVP_NODE_ID": str(spec.node_id),
            "MVP_STAGE_INDEX": str(spec.stage_index),
            "MVP_TASK_QUEUE": spec.task_queue,
            "MVP_READINESS_ID": spec.readiness_id,
            "MVP_RUN_WORKFLOW_ID": spec.run_workflow_id,
            "MVP_AUTHORIZED_ORCHESTRATOR": spec.authorized_orchestrator,
            "MVP_TEMPORAL_NAMESPACE": spec.temporal_namespace,
            "MVP_NODE_DIR": node_dir,
            EDGE_TOKEN_ENV: edge_token(secret, spec.run_workflow_id, spec.nonce),
            TEXT_TOKEN_ENV: text_stream_token(secret, spec.run_workflow_id, spec.nonce),
        }
    )
    return env


def node_text(text: str) -> str:
    """``text`` from a node (its log, its reports) fit to leave this host: every secret of
    this worker's environment (the node's own payload key, the Temporal API key, the
    edge secret its token derives from, HF_TOKEN, provider keys) and whatever looks like
    a secret (``hf_...``, ``Bearer ...``, ``NAME_TOKEN=...``) replaced with ``[redacted]``.
    Fault texts go into workflow history, where secrets never go."""
    return Redactor.from_env(os.environ).redact_text(text)


def last_log_line(output: str, *, partial: bool = False) -> str:
    """The ``; last log line: ...`` part of a fault text: the last non-empty line of a
    node's output, redacted (:func:`node_text`), then cut to ``LOG_LINE_MAX`` characters;
    "" when there is none. ``partial``: ``output`` starts inside a line (a tail read from
    the middle of a log), whose first, cut line is dropped, or, if it is the only one,
    its first word (which may be the cut end of a secret)."""
    lines = output.splitlines()
    if partial and lines:
        if len(lines) > 1:
            lines = lines[1:]
        else:
            cut = lines[0].split(None, 1)
            lines = ["..." + cut[1]] if len(cut) > 1 else []
    lines = [line for line in lines if line.strip()]
    if not lines:
        return ""
    return f"; last log line: {node_text(lines[-1].strip())[:LOG_LINE_MAX]}"


def log_file_tail(path: str | None) -> str:
    """:func:`last_log_line` of a node's log ("" without one): of its stdout file
    (``path``) or its stderr file beside it (``node.err``), whichever was written last."""
    if path is None:
        return ""
    found: list[tuple[int, str]] = []
    for candidate in (Path(path), Path(path).with_name(NODE_STDERR_FILE)):
        try:
            with open(candidate, "rb") as f:
                mtime = os.fstat(f.fileno()).st_mtime_ns
                f.seek(0, os.SEEK_END)
                start = max(f.tell() - _TAIL_BYTES, 0)
                f.seek(start)
                raw = f.read()
        except OSError:
            continue
        tail = last_log_line(raw.decode(errors="replace"), partial=start > 0)
        if tail:
            found.append((mtime, tail))
    return max(found)[1] if found else ""
