"""The programs' own lines on stderr (workers/stdio.py): one ``say`` for the host and the
gateway, written to stderr as it is at the call, never raising when nobody reads it."""

from __future__ import annotations

import contextlib
import io
import os

import pytest

from workers.gateway import main as gateway
from workers.host import main as host
from workers.stdio import sayer


@pytest.mark.parametrize(
    ("say", "prog"), [(gateway.say, "mvp-gateway"), (host.say, "mvp-orchestrator")]
)
def test_each_program_says_its_lines_on_stderr_as_it_is_now(
    say, prog, monkeypatch: pytest.MonkeyPatch
) -> None:
    captured = io.StringIO()  # e.g. the host's tee into its datastream, set after import
    monkeypatch.setattr("sys.stderr", captured)
    say("run mvp-run-7 closed: shutdown")
    assert captured.getvalue() == f"{prog}: run mvp-run-7 closed: shutdown\n"


@pytest.mark.parametrize("say", [gateway.say, host.say, sayer("mvp-chat")])
def test_a_line_nobody_can_read_is_dropped_not_raised(say, monkeypatch: pytest.MonkeyPatch) -> None:
    read, write = os.pipe()
    os.close(read)  # `2>&1 | tee log`, tee gone: every write fails with EPIPE
    dead = os.fdopen(write, "w", buffering=1)
    monkeypatch.setattr("sys.stderr", dead)
    say("shutting down")  # no BrokenPipeError
    dead_closed = io.StringIO()
    dead_closed.close()
    monkeypatch.setattr("sys.stderr", dead_closed)
    say("shutting down")  # no ValueError (a closed file)
    with contextlib.suppress(OSError):
        dead.close()
