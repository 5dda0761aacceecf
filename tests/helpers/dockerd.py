"""A private Docker daemon for the tests: its own data root, exec root, pid file, socket
and address pool, so it never touches another daemon's containers, and it is stopped
(with everything it ran) when the tests end. scripts/test installs docker.io first."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import docker

from tests.helpers.waits import wait_until

# Where the test daemon allocates run networks (a /24 each): away from the usual
# 172.17-31 ranges, so that a host daemon and this one do not fight over addresses.
ADDRESS_POOL = "base=10.213.0.0/16,size=24"


@dataclass
class Dockerd:
    proc: subprocess.Popen[bytes]
    root: Path

    @property
    def host(self) -> str:
        """The DOCKER_HOST of this daemon."""
        return f"unix://{self.root / 'docker.sock'}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_dockerd(root: Path, timeout_s: float = 30.0) -> Dockerd:
    """Start ``dockerd`` under ``root`` (a short path: unix sockets cap at 107 bytes)."""
    binary = shutil.which("dockerd")
    if binary is None:
        raise RuntimeError("dockerd is missing: apt-get install -y docker.io (scripts/test does)")
    root.mkdir(parents=True, exist_ok=True)
    sock = root / "docker.sock"
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()
    log = open(root / "dockerd.log", "ab")
    proc = subprocess.Popen(
        [
            binary,
            "--data-root",
            str(root / "data"),
            "--exec-root",
            str(root / "exec"),
            "--pidfile",
            str(root / "dockerd.pid"),
            "--host",
            f"unix://{sock}",
            "--bridge",
            "none",  # no default bridge: every run makes its own network
            "--default-address-pool",
            ADDRESS_POOL,
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    daemon = Dockerd(proc, root)

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(
                f"dockerd exited: {(root / 'dockerd.log').read_text(errors='replace')[-2000:]}"
            )
        if sock.exists():
            with contextlib.suppress(docker.errors.DockerException):
                return bool(docker.DockerClient(base_url=daemon.host, timeout=5).ping())
        return False

    try:
        wait_until(answers, timeout=timeout_s, what="dockerd to answer a ping", interval=0.2)
    except BaseException:
        daemon.stop()
        raise
    return daemon
