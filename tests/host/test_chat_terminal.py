"""``mvp-chat`` in a terminal (a pty, so Ctrl-C is the terminal's SIGINT), against a
stand-in prompt RPC: Ctrl-C during a reply cancels that reply and the session goes on to
the next prompt; Ctrl-C at the prompt ends it."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]


class StandInRpc:
    """The prompt RPC's wire (CONTRACTS "Prompt RPC"): "forever" streams until its client
    goes away, anything else is answered with two words and done."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.requests: list[int] = []
        self.gone: list[int] = []  # request ids whose connection closed mid-reply

    def start(self) -> None:
        """Serve (after the terminal's fork: no thread of ours is forked)."""
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                req = json.loads(line)
                rid = req["request_id"]
                self.requests.append(rid)
                try:
                    if req["prompt_text"] == "forever":
                        while True:
                            self._send(
                                conn, {"type": "text_delta", "request_id": rid, "text": " tick"}
                            )
                            time.sleep(0.05)
                    self._send(
                        conn, {"type": "text_delta", "request_id": rid, "text": " two words"}
                    )
                    done = {"type": "done", "request_id": rid, "final_text": " two words",
                            "tokens_generated": 2, "elapsed_ms": 5, "stop_reason": "eos"}  # fmt: skip
                    self._send(conn, done)
                except OSError:
                    self.gone.append(rid)
                    return

    @staticmethod
    def _send(conn: socket.socket, event: dict[str, object]) -> None:
        conn.sendall(json.dumps(event).encode() + b"\n")

    def close(self) -> None:
        self.sock.close()


class Terminal:
    def __init__(self, argv: list[str]) -> None:
        env = {**os.environ, "TERM": "dumb", "PYTHONUNBUFFERED": "1"}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            os.chdir(REPO)
            os.execve(sys.executable, [sys.executable, *argv], env)
        self.screen = ""

    def type(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait_for(self, wanted: str, count: int = 1, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while self.screen.count(wanted) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"waited for {wanted!r} x{count}; the screen:\n{self.screen}"
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if ready:
                try:
                    self.screen += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:  # the child is gone
                    assert self.screen.count(wanted) >= count, self.screen
        return self.screen

    def exit_code(self, timeout: float = 15.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with_fd = select.select([self.fd], [], [], 0.1)[0]
            if with_fd:
                try:
                    self.screen += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:
                    pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"mvp-chat did not exit; the screen:\n{self.screen}")

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


def test_ctrl_c_during_a_reply_cancels_it_and_the_session_goes_on():
    rpc = StandInRpc()
    term = Terminal(["-m", "workers.host.chat", "--rpc", f"127.0.0.1:{rpc.port}", "--raw"])
    rpc.start()
    try:
        term.wait_for("prompt:> ")
        term.type(b"forever\r")
        term.wait_for(" tick", count=3)
        term.type(b"\x03")  # Ctrl-C: the terminal's SIGINT
        term.wait_for("cancelled request 1")
        term.wait_for("prompt:> ", count=2)  # the session goes on
        deadline = time.monotonic() + 10
        while rpc.gone != [1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rpc.gone == [1], "the cancelled reply's connection stayed open"
        term.type(b"and now\r")
        term.wait_for("[2 tokens, stopped by eos, 5 ms]")
        term.wait_for("prompt:> ", count=3)
        assert rpc.requests == [1, 2]
        term.type(b"\x03")  # Ctrl-C at the prompt ends the session
        assert term.exit_code() == 130
        assert "Traceback" not in term.screen, term.screen
    finally:
        term.close()
        rpc.close()
