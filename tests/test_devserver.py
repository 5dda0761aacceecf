"""The dev server launcher (temporal/devserver.py) under port races: a free port it hands
the server can be taken by another process first (four shards of this suite start
servers, nodes and proxies at once). Then something listens there, but not the server:
the launcher must not take that for its server being ready."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from temporal import devserver
from temporal.devserver import _listener_is, start_dev_server

HOLD = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print(s.getsockname()[1], flush=True); time.sleep(120)\n"
)


@pytest.fixture
def foreign_port() -> Iterator[int]:
    """A port another process listens on."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def test_the_listener_of_a_port_is_known_by_its_process(foreign_port: int) -> None:
    own = socket.socket()
    own.bind(("127.0.0.1", 0))
    own.listen()
    with own:
        port = own.getsockname()[1]
        assert _listener_is(os.getpid(), port) is True
        assert _listener_is(os.getpid(), foreign_port) is False


def test_a_port_taken_before_the_server_binds_it_is_not_its_readiness(
    foreign_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = iter([foreign_port])
    real = devserver.free_port
    # The first free port handed out is taken by then; later ones are really free.
    monkeypatch.setattr(devserver, "free_port", lambda: next(ports, None) or real())
    srv = start_dev_server(None)
    try:
        assert srv.port != foreign_port
        assert srv.process.poll() is None and _listener_is(srv.process.pid, srv.port)
    finally:
        srv.stop()


def test_a_server_that_exits_after_it_was_ready_says_how_and_why(tmp_path) -> None:
    log = tmp_path / "temporal.log"
    log.write_text("Error: an older server's cause\n")  # not this server's output
    srv = start_dev_server(None, log_file=str(log))
    try:
        assert srv.exited() is None
        with open(log, "a") as fh:  # what a server writes as it stops on an error
            fh.write("Error: listen tcp 127.0.0.1:40001: bind: address already in use\n")
        srv.process.kill()
        srv.process.wait(10)
        assert srv.exited() == (
            f"the temporal dev server on port {srv.port} exited with -9: "
            "listen tcp 127.0.0.1:40001: bind: address already in use"
        )
    finally:
        srv.stop()


def test_a_file_backed_server_keeps_a_write_ahead_log_and_what_it_committed_survives_a_kill(
    tmp_path,
) -> None:
    """DECISIONS 102: the SQLite file is in WAL mode (its -wal file beside it), and a
    workflow started before the server was killed hard is there after a restart."""
    import asyncio

    from temporalio.client import Client

    db = tmp_path / "dev.db"
    srv = start_dev_server(str(db))
    try:
        assert (tmp_path / "dev.db-wal").exists()

        async def start() -> None:
            client = await Client.connect(srv.address)
            await client.start_workflow("NoSuchWorkflow", id="kept", task_queue="nobody-polls")

        asyncio.run(start())
        srv.process.kill()  # no shutdown: nothing flushed on the way out
        srv.process.wait(10)
    finally:
        srv.stop()
    again = start_dev_server(str(db))
    try:

        async def describe() -> str:
            client = await Client.connect(again.address)
            return (await client.get_workflow_handle("kept").describe()).workflow_type

        assert asyncio.run(describe()) == "NoSuchWorkflow"
    finally:
        again.stop()
