"""The host follows its run's datastream and forwards it (DECISIONS 58).

The run's datastream activity publishes the run's records (lifecycle, provisioning,
membership, routes, node logs, provider progress). The host subscribes to it (the address
is in the run's snapshot) and passes every frame into its own datastream (its archive,
its follow socket) with the frame's identity kept (``Datastream.forward``); the host adds
only its own records, on its own stream.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any

from mvp_core.datastream import CHANNEL_LIFECYCLE, decode_payload
from mvp_io.datastream import Datastream
from workers.host.follow import connect

_RECV = 64 * 1024


class Forwarder:
    """A thread that reads one datastream address and forwards its frames until the
    stream ends (the activity closed it: the run's end, or an attempt's)."""

    def __init__(self, stream: Datastream, address: str, *, connect_timeout_s: float = 5.0):
        self.stream = stream
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.forwarded = 0
        self.connected = threading.Event()
        self.failed: str | None = None  # why it could not connect
        self._kinds: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self.thread = threading.Thread(target=self._run, name="datastream-forward", daemon=True)

    def start(self) -> Forwarder:
        self.thread.start()
        return self

    def seen(self, kind: str) -> bool:
        """Whether a lifecycle record of ``kind`` came through."""
        with self._lock:
            return kind in self._kinds

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        """Wait for the stream's end; True when it ended."""
        self.thread.join(max(0.0, timeout_s))
        return not self.thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        try:
            sock = connect(self.address, self.connect_timeout_s)
        except (OSError, ValueError) as err:
            self.failed = str(err) or type(err).__name__
            return
        self._sock = sock
        self.connected.set()
        buf = bytearray()
        try:
            sock.settimeout(0.5)
            while not self._stop.is_set():
                try:
                    data = sock.recv(_RECV)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                buf += data
                start = 0
                while (nl := buf.find(b"\n", start)) >= 0:
                    self._line(bytes(buf[start:nl]))
                    start = nl + 1
                del buf[:start]
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def _line(self, raw: bytes) -> None:
        try:
            line: dict[str, Any] = json.loads(raw)
        except ValueError:
            return
        if not isinstance(line, dict) or not self.stream.forward(line):
            return
        self.forwarded += 1
        if line.get("channel") == CHANNEL_LIFECYCLE:
            with contextlib.suppress(Exception):
                record = decode_payload(line)
                if isinstance(record, dict) and "kind" in record:
                    with self._lock:
                        self._kinds.add(str(record["kind"]))


def wait_seen(forwarder: Forwarder | None, kind: str, timeout_s: float) -> None:
    """Block (bounded) until ``kind`` came through the forwarder (none: at once)."""
    if forwarder is None:
        return
    deadline = time.monotonic() + timeout_s
    while not forwarder.seen(kind) and not forwarder.done and time.monotonic() < deadline:
        time.sleep(0.02)
