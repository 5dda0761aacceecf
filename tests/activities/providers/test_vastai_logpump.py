"""A rented node's output followed as it runs (issue 38 item 1), without an instance: the
SSH session's command runs here (``sh -c``), against a directory standing in for the
instance's. Each stream apart; a session that drops is started again from the bytes this
host has (nothing lost, nothing twice); the stop ends the sessions."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from activities.providers.pidstart import recorded_alive
from activities.providers.vastai import logpump, records
from activities.providers.vastai.records import InstanceRecord


@pytest.fixture
def instance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[InstanceRecord, Path, Path]:
    remote, local = tmp_path / "instance", tmp_path / "here"
    remote.mkdir()
    monkeypatch.setattr(logpump, "REMOTE_NODE_DIR", str(remote))
    monkeypatch.setattr(logpump, "ssh_base", lambda record: ["sh", "-c"])
    monkeypatch.setattr(records, "node_dir", lambda label: local / label)
    return (
        InstanceRecord(instance_id=7, label="mvp-9-1-abcdefab"),
        remote,
        local / "mvp-9-1-abcdefab",
    )


def test_each_stream_is_followed_apart_and_a_dropped_session_goes_on_where_it_was(instance):
    record, remote, here = instance
    (remote / "node.log").write_bytes(b"out 1\n")
    (remote / "node.err").write_bytes(b"err 1\n")
    logpump.ensure_log_pump(record)
    try:
        eventually_sync(lambda: (here / "node.log").read_bytes() == b"out 1\n")
        eventually_sync(lambda: (here / "node.err").read_bytes() == b"err 1\n")
        with (remote / "node.log").open("ab") as f:
            f.write(b"out 2\n")
        eventually_sync(lambda: (here / "node.log").read_bytes() == b"out 1\nout 2\n")
        # The session of stdout drops; the node writes on; the poll starts it again.
        session = recorded_alive(logpump.pump_file(record.label, "node.log"))
        assert session is not None
        os.killpg(session.pid, signal.SIGKILL)
        eventually_sync(lambda: recorded_alive(logpump.pump_file(record.label, "node.log")) is None)
        with (remote / "node.log").open("ab") as f:
            f.write(b"out 3\n")
        logpump._restarted[record.label] = 0.0  # the restart interval has passed
        logpump.keep_log_pump_up(record.label, record)
        eventually_sync(lambda: (here / "node.log").read_bytes() == b"out 1\nout 2\nout 3\n")
        # Right after a restart the poll dials nothing (an instance that is gone is not
        # dialled every poll).
        before = recorded_alive(logpump.pump_file(record.label, "node.log"))
        logpump.keep_log_pump_up(record.label, record)
        assert recorded_alive(logpump.pump_file(record.label, "node.log")) == before
    finally:
        assert logpump.close_log_pump(record.label)
    assert not logpump.pump_file(record.label, "node.log").exists()
    assert not logpump.close_log_pump(record.label)  # nothing recorded any more
    assert (here / "node.err").read_bytes() == b"err 1\n"


def eventually_sync(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within 10 s"
        time.sleep(0.05)
