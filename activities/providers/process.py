"""The process provider: node agents as local detached processes.

Each node runs in its own session and process group, with its output in a log file, so
it outlives the orchestrator worker that started it. Start is idempotent at its source:
the node's command line carries its resource name (run_id, node_id, nonce), and a
retried start looks for a live process with that name before it launches another, so a
worker killed between launching a node and recording it never starts the node twice.
A pid file keeps the record; the recorded process start (the kernel's start ticks, which
no clock step moves: ``pidstart``) guards against pid reuse.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from activities.providers.base import (
    NODE_STDERR_FILE,
    NodeStartFailed,
    Progress,
    ProviderUnavailable,
    harness_crash,
    harness_faults,
    log_file_tail,
    node_environment,
    node_exited,
    state_dir,
    temporal_scope,
)
from activities.providers.pidstart import ProcessStart, read_record, write_record
from mvp_core import names
from mvp_core.models import (
    NodeExited,
    NodeHandle,
    NodeProvisionSpec,
    ProviderKind,
    ProviderResource,
    StopNodeResult,
)
from mvp_core.names import NODE_MODULE, parse_resource_name, resource_arg
from mvp_io.node_processes import marked_node_processes

_PASS_ENV = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "TMPDIR",
    "MVP_MODELS_DIR",
    "MVP_SWITCH_INTERVAL",
    "MVP_PREFIX_CACHE_MB",  # a stage's prefix cache cap (0: off; DECISIONS 91)
    "XDG_CACHE_HOME",
    "CUDA_VISIBLE_DEVICES",
)


# A node directory's record of whose node it is, written before the node is launched:
# its run's workflow id and the deployment (Temporal address and namespace) that started
# it. A state directory is shared by every deployment of its user (the default one, or
# one MVP_STATE_DIR names), so the reaper sweeps only its own deployment's (DECISIONS 97).
RUN_FILE = "run.json"
# Where this host's process nodes listen on their data-plane port and what they advertise
# (default 127.0.0.1: reachable from this host only). The operator's, never a run's: an
# address of this host that readers of the head node's text on other hosts reach
# (docs/gateway.md); a wildcard makes nodes advertise the address this host's name
# resolves to.
DATAPLANE_HOST_ENV = "MVP_PROCESS_DATAPLANE_HOST"
log = logging.getLogger(__name__)


def write_run_record(node_dir: Path, run_workflow_id: str, scope: tuple[str, str]) -> None:
    """Record whose node ``node_dir`` holds: ``run_workflow_id``, of the deployment
    ``scope`` (:func:`temporal_scope`)."""
    address, namespace = scope
    record = {
        "run_workflow_id": run_workflow_id,
        "temporal_address": address,
        "temporal_namespace": namespace,
    }
    tmp = node_dir / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, node_dir / RUN_FILE)


def read_run_record(node_dir: Path) -> tuple[str, tuple[str, str]] | None:
    """(run workflow id, deployment scope) as recorded in ``node_dir``; None without a
    whole record (a node of a release that recorded no deployment: no sweep's own)."""
    try:
        rec = json.loads((node_dir / RUN_FILE).read_text())
        values = (rec["run_workflow_id"], rec["temporal_address"], rec["temporal_namespace"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not all(isinstance(v, str) and v for v in values):
        return None
    run_workflow_id, address, namespace = values
    return run_workflow_id, (address, namespace)


def _alive(pid: int, start: ProcessStart | None) -> bool:
    """Whether ``pid`` runs and is the process whose start was recorded (not a zombie,
    not a later process of a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if start is not None and not start.matches(proc):
            return False
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def find_node_process(name: str) -> psutil.Process | None:
    """The live node process of this execution, if one runs (whoever launched it)."""
    mark = resource_arg(name)
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if mark in (proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


# The reaper's stop of a node of a closed run: the grace of a run's default stop.
DESTROY_GRACE_S = 5.0


def _nodes_root() -> Path:
    return state_dir() / "nodes"


EXIT_FILE = "exit.json"
STDERR_FILE = NODE_STDERR_FILE  # a node's stderr, beside its stdout (node.log)
REAP_WAIT_S = 2.0  # how long a gone node's exit status may take to become collectable
# The nodes this process launched, kept so that the subprocess module never reaps one
# behind _reap's back (a dropped Popen polls its child when collected, and every new
# Popen polls the dropped ones): the exit status is read, and recorded, here.
_launched: dict[int, subprocess.Popen[bytes]] = {}


def _reap(pid: int, node_dir: Path | None = None) -> bool:
    """Collect the exit of a node this process launched (one it adopted is not its
    child), and record it in ``exit.json`` in the node's directory: ``status`` (the exit
    code, None when a signal ended it) and ``signal`` (its name, e.g. SIGABRT). False
    while it is our child and not yet collectable."""
    try:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True  # reaped already, or not our child: nothing to wait for
    if done != pid:
        return False
    _launched.pop(pid, None)
    if node_dir is None:
        return True
    code = os.waitstatus_to_exitcode(wait_status)
    sig = signal.Signals(-code).name if code < 0 else None
    rec = {"pid": pid, "status": None if sig else code, "signal": sig}
    tmp = node_dir / (EXIT_FILE + ".tmp")
    try:
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, node_dir / EXIT_FILE)
    except OSError:
        pass
    if code != 0:
        log.warning("node %s (pid %d) exited with %s", node_dir.name, pid, sig or f"status {code}")
    return True


def _gone(pid: int, start: ProcessStart | None, node_dir: Path | None) -> bool:
    """Whether the node has exited; its exit is collected (and recorded) either way,
    also when it exits between the two looks or shows as a zombie before it can be."""
    _reap(pid, node_dir)
    if _alive(pid, start):
        return False
    # A zombie group leader is reapable only once its last thread is gone: wait that out.
    deadline = time.monotonic() + REAP_WAIT_S
    while not _reap(pid, node_dir) and time.monotonic() < deadline:
        time.sleep(0.01)
    return True


class ProcessProvider:
    def __init__(self, *, python: str | None = None, host: str | None = None) -> None:
        self.python = python or sys.executable
        self.host = host or socket.gethostname()
        self._scope: tuple[str, str] | None = None

    @property
    def scope(self) -> tuple[str, str]:
        """This worker's deployment (Temporal address, namespace): its nodes record it,
        and its sweep lists only nodes that do."""
        if self._scope is None:
            self._scope = temporal_scope()
        return self._scope

    def check(self, spec_gpus: str | None) -> None:
        if not os.access(self.python, os.X_OK):
            raise ProviderUnavailable(f"local process worker binary does not exist: {self.python}")

    def _node_dir(self, run_id: int, node_id: int, nonce: str) -> Path:
        return state_dir() / "nodes" / names.node_resource_name(run_id, node_id, nonce)

    def start(self, spec: NodeProvisionSpec, progress: Progress | None = None) -> NodeHandle:
        node_dir = self._node_dir(spec.run_id, spec.node_id, spec.nonce)
        node_dir.mkdir(parents=True, exist_ok=True)
        # One attempt at a time per node: an attempt whose heartbeat timed out on a loaded
        # machine may still be launching when the retry begins, before its pid file exists
        # and while the child's command line is not yet the node's (seen in the chaos
        # matrix as one node started twice). The retry waits, then adopts its node.
        with open(node_dir / "start.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._start_locked(spec, node_dir)

    def _start_locked(self, spec: NodeProvisionSpec, node_dir: Path) -> NodeHandle:
        name = names.node_resource_name(spec.run_id, spec.node_id, spec.nonce)
        pid_file = node_dir / "pid.json"
        log_path = node_dir / "node.log"
        run_file = node_dir / RUN_FILE
        if not run_file.exists():  # before the launch: the reaper reads whose node it is
            write_run_record(node_dir, spec.run_workflow_id, self.scope)
        if pid_file.exists():
            rec = json.loads(pid_file.read_text())
            return self._handle(spec, name, int(rec["pid"]), log_path)
        running = find_node_process(name)
        if running is not None:
            # Launched by an attempt that died before it could record it: adopt it.
            self._record(pid_file, running.pid, ProcessStart.of(running))
            return self._handle(spec, name, running.pid, log_path)
        env = node_environment(
            spec,
            str(node_dir),
            host_env={k: os.environ[k] for k in _PASS_ENV if k in os.environ},
            shared_address=True,
        )
        # On the worker's host: early starts only where they leave the admission a core.
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "OMP_WAIT_POLICY": "PASSIVE",
                names.SHARES_CONTROL_HOST_ENV: "1",
            }
        )
        listen = os.environ.get(DATAPLANE_HOST_ENV, "").strip()
        if listen:
            env["MVP_DATAPLANE_HOST"] = listen
        if harness_faults(spec.run_id).get("MVP_FAULT_START_FAIL") == "1":
            # Test harness only: the provider cannot start this node (ProvisionFailed).
            raise NodeStartFailed(f"injected start failure of node {spec.node_id}")
        log.info("starting node %s (%s) in %s", spec.node_id, name, node_dir)
        # The node's fds 1 and 2 are these files (its native code writes there too):
        # stdout in node.log, stderr apart in node.err (the run's datastream tails both).
        with open(log_path, "ab") as out, open(node_dir / STDERR_FILE, "ab") as err:
            proc = subprocess.Popen(
                [self.python, "-m", NODE_MODULE, resource_arg(name)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                cwd=str(node_dir),
            )
        _launched[proc.pid] = proc
        harness_crash("1")  # the worker dies before recording the node
        self._record(pid_file, proc.pid, ProcessStart.of(psutil.Process(proc.pid)))
        return self._handle(spec, name, proc.pid, log_path)

    _record = staticmethod(write_record)

    def _handle(self, spec: NodeProvisionSpec, name: str, pid: int, log_path: Path) -> NodeHandle:
        return NodeHandle(
            run_id=spec.run_id,
            node_id=spec.node_id,
            provider=ProviderKind.PROCESS,
            host=self.host,
            pid=pid,
            log_path=str(log_path),
            resource_name=name,
        )

    @staticmethod
    def _node_dir_of(handle: NodeHandle) -> Path | None:
        return None if handle.log_path is None else Path(handle.log_path).parent

    def _recorded_start(self, handle: NodeHandle) -> ProcessStart | None:
        if handle.log_path is None:
            return None
        rec = read_record(Path(handle.log_path).with_name("pid.json"))
        return None if rec is None else rec[1]

    def complete_bootstrap(self, handle: NodeHandle) -> None:
        """Nothing to undo: the node's environment was given to its process alone (no
        file of it is left on the host)."""

    def stop(self, handle: NodeHandle, grace_s: float) -> StopNodeResult:
        result = self._stop(handle, grace_s)
        if (
            harness_faults(handle.run_id).get("MVP_FAULT_PROVIDER_STOP") == "1"
            and result.error is None
        ):
            # Test harness only: the node is stopped, but the provider reports it was not.
            return StopNodeResult(
                node_id=handle.node_id, stopped=False, error="injected provider stop failure"
            )
        return result

    def _stop(self, handle: NodeHandle, grace_s: float) -> StopNodeResult:
        if handle.pid is None:
            # Teardown of a node whose start never reported back: find it by its mark.
            running = find_node_process(handle.resource_name)
            if running is None:
                return StopNodeResult(node_id=handle.node_id, stopped=True)
            handle = handle.model_copy(update={"pid": running.pid})
        pid = handle.pid
        if pid is None:
            return StopNodeResult(node_id=handle.node_id, stopped=True)
        start = self._recorded_start(handle)
        node_dir = self._node_dir_of(handle)
        if _gone(pid, start, node_dir):
            return StopNodeResult(node_id=handle.node_id, stopped=True)
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            return StopNodeResult(node_id=handle.node_id, stopped=True)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if _gone(pid, start, node_dir):
                return StopNodeResult(node_id=handle.node_id, stopped=True)
            time.sleep(0.05)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            return StopNodeResult(node_id=handle.node_id, stopped=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if _gone(pid, start, node_dir):
                return StopNodeResult(node_id=handle.node_id, stopped=True)
            time.sleep(0.05)
        return StopNodeResult(
            node_id=handle.node_id, stopped=False, error=f"process group {pid} survived SIGKILL"
        )

    def poll_exited(self, handles: list[NodeHandle]) -> NodeExited | None:
        for handle in handles:
            if handle.pid is None:
                continue
            if _gone(handle.pid, self._recorded_start(handle), self._node_dir_of(handle)):
                return node_exited(
                    handle, f"process {handle.pid} is gone{log_file_tail(handle.log_path)}"
                )
        return None

    # ------------------------------------------------------------------ the reaper's sweep

    def _own_run(self, name: str) -> str | None:
        """The run workflow id recorded for node ``name`` when this deployment started
        it; None when another deployment did (or no record says which)."""
        rec = read_run_record(_nodes_root() / name)
        return rec[0] if rec is not None and rec[1] == self.scope else None

    def _resource(self, name: str, run_workflow_id: str, detail: str) -> ProviderResource:
        parsed = parse_resource_name(name)
        assert parsed is not None
        return ProviderResource(
            provider=ProviderKind.PROCESS,
            kind="process",
            name=name,
            # The id the run was started with (any workflow id may carry a run_id), as
            # recorded at start.
            run_workflow_id=run_workflow_id,
            nonce8=parsed[2],
            host=self.host,
            detail=detail,
        )

    def list_resources(self) -> list[ProviderResource]:
        """Live marked node processes of this state directory, and node directories
        whose recorded process is gone ("dead": only the record is left to remove): of
        those this deployment started alone. Another deployment's, whose runs this
        deployment's Temporal does not know, are its own reaper's (DECISIONS 97)."""
        root = _nodes_root()
        found: dict[str, ProviderResource] = {}
        for name, proc in marked_node_processes(root).items():
            run = self._own_run(name)
            if run is not None:
                found[name] = self._resource(name, run, f"live, pid {proc.pid}")
        try:
            dirs = sorted(d for d in root.iterdir() if d.is_dir())
        except FileNotFoundError:
            dirs = []
        for node_dir in dirs:
            name = node_dir.name
            if name in found or parse_resource_name(name) is None:
                continue
            run = self._own_run(name)
            if run is None:
                continue  # another deployment's, or a start before its record
            rec = read_record(node_dir / "pid.json")
            if rec is None:
                continue  # never recorded (a start in flight) or already reaped
            pid, start = rec
            if _alive(pid, start):
                found[name] = self._resource(name, run, f"live, pid {pid} (recorded)")
            else:
                found[name] = self._resource(
                    name, run, f"dead: pid {pid} is gone, its record is left"
                )
        return [found[name] for name in sorted(found)]

    def destroy(self, resource: ProviderResource) -> None:
        """Stop the node as a run's stop does (SIGTERM to its group, grace, SIGKILL),
        then remove its record (``pid.json``; ``node.log`` stays). "Not found" is success;
        another deployment's node is left alone (an error: DECISIONS 97)."""
        if parse_resource_name(resource.name) is None:
            return
        node_dir = _nodes_root() / resource.name
        pid_file = node_dir / "pid.json"
        rec = read_record(pid_file)
        running = marked_node_processes(_nodes_root()).get(resource.name)
        if running is None and rec is None:
            return
        if self._own_run(resource.name) is None:
            raise RuntimeError(
                f"node {resource.name} is not this deployment's "
                f"(Temporal {self.scope[0]}, namespace {self.scope[1]}): left alone"
            )
        handle = NodeHandle(
            run_id=0,
            node_id=0,
            provider=ProviderKind.PROCESS,
            host=self.host,
            resource_name=resource.name,
        )
        if running is not None:
            # Found by its mark just now: no recorded start time to check it against.
            handle.pid = running.pid
        elif rec is not None and _alive(*rec):
            handle.pid, handle.log_path = rec[0], str(node_dir / "node.log")
        if handle.pid is not None:
            result = self._stop(handle, DESTROY_GRACE_S)
            if not result.stopped:
                raise RuntimeError(result.error or f"node {resource.name} did not stop")
        for path in (pid_file, pid_file.with_suffix(".tmp")):
            path.unlink(missing_ok=True)
