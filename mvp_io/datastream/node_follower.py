"""The follower of one node's own datastream (DECISIONS 93): connects to the node's
data-plane port, authenticates like an edge (``mvp_core.edge_auth``: the hello on
``NODE_DATASTREAM_EDGE_ID`` with the node-datastream token), reads the node's header,
channels and frames (``mvp_core.node_datastream``) and passes each frame on into a run's
``Datastream`` (``relay``: source ``node_datastream``, the node's stream, its positions).

Its own thread; never raises into its caller. The node is untrusted: a line that fails
its checks is dropped and logged (at most one log line per ``LOG_EVERY_S`` per node, with
the count dropped meanwhile), at most ``MAX_FRAMES_PER_S`` frames a second are passed on
(past that, counted and dropped), and a header of another run or node ends the follow. A
connection that fails or ends without the node's end is made again (backoff up to
``RETRY_MAX_S``) until ``stop``, or until ``finish`` (the node is gone: the connection
open now is read to its end, for at most ``grace_s``, and none is made again); a refusal
(a wrong token) is logged once per change."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Mapping

from mvp_core.edge_auth import ANSWER, ANSWER_OK, NODE_DATASTREAM_EDGE_ID, hello
from mvp_core.node_datastream import (
    MAX_LINE_BYTES,
    Accepted,
    NodeStreamReader,
    StreamEnd,
    WireError,
)
from mvp_io.datastream.publisher import Datastream

log = logging.getLogger("mvp.datastream")

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 1.0  # how often a quiet connection looks whether it was stopped
RETRY_S = 0.5
RETRY_MAX_S = 5.0
MAX_FRAMES_PER_S = 50.0  # passed on per node (a burst of BURST_FRAMES first: the replay)
BURST_FRAMES = 1_000.0
LOG_EVERY_S = 30.0


class NodeFollower:
    """Follows node ``node_id`` of run ``run_id`` at ``endpoint`` (``host:port``)."""

    def __init__(
        self,
        datastream: Datastream,
        *,
        run_id: int,
        node_id: int,
        endpoint: str,
        token: str,
        last: Mapping[str, int] | None = None,
    ) -> None:
        self._ds = datastream
        self.node_id = int(node_id)
        self.endpoint = endpoint
        self._token = token
        self.reader = NodeStreamReader(run_id, node_id, last)
        self._stop = threading.Event()
        self._finish_by: float | None = None  # the node is gone: read no longer than this
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.ended: str | None = None  # the node's end reason, once it said so
        self.passed = 0  # frames passed on
        self.dropped = 0  # lines dropped (malformed, unexpected, over the rate)
        self.connections = 0
        self._said: str | None = None  # the last connection failure logged
        self._log_at = 0.0
        self._unlogged = 0
        self._tokens = BURST_FRAMES
        self._refill_at = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"node-follower-{self.node_id}", daemon=True
        )

    @property
    def last(self) -> dict[str, int]:
        """Each channel's last position passed on (where a later follower resumes)."""
        return dict(self.reader.last)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> NodeFollower:
        self._thread.start()
        return self

    def finish(self, grace_s: float = 5.0) -> None:
        """The node is gone: read what its open connection still brings (its last frames,
        its end) for at most ``grace_s``, and make no new one."""
        if self._finish_by is None:
            self._finish_by = time.monotonic() + grace_s

    def _finishing(self) -> bool:
        return self._finish_by is not None and (
            self.reader.header is None or time.monotonic() >= self._finish_by
        )

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop following (a connection in progress is closed)."""
        self._stop.set()
        with self._lock:
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # -- the thread

    def _run(self) -> None:
        delay = RETRY_S
        while not self._stop.is_set() and self.ended is None:
            try:
                got = self._follow_once()
            except Exception as err:  # observation never dies of a node's bytes
                self._say(f"node {self.node_id} datastream: {type(err).__name__}: {err}")
                got = False
            if self.ended is not None or self._stop.is_set() or self._finish_by is not None:
                break
            delay = RETRY_S if got else min(delay * 2, RETRY_MAX_S)
            self._stop.wait(delay)

    def _follow_once(self) -> bool:
        """One connection; True when it got as far as the node's header."""
        host, _, port = self.endpoint.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S)
        except (OSError, ValueError) as err:
            self._say(f"node {self.node_id} datastream at {self.endpoint} not reached: {err}")
            return False
        with self._lock:
            self._sock = sock
        try:
            self.connections += 1
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.sendall(hello(NODE_DATASTREAM_EDGE_ID, self._token))
            status, length = ANSWER.unpack(_recv_exact(sock, ANSWER.size))
            reason = _recv_exact(sock, length).decode("utf-8", "replace") if length else ""
            if status != ANSWER_OK:
                said = reason if len(reason) <= 200 else reason[:200] + "..."
                self._say(f"node {self.node_id} datastream refused the follower: {said!r}")
                return False
            self.reader.reconnected()
            sock.settimeout(READ_TIMEOUT_S)
            return self._read(sock)
        except (OSError, EOFError) as err:
            if not self._stop.is_set():
                self._say(f"node {self.node_id} datastream at {self.endpoint} lost: {err}")
            return self.reader.header is not None
        finally:
            with self._lock:
                self._sock = None
            with contextlib.suppress(OSError):
                sock.close()

    def _read(self, sock: socket.socket) -> bool:
        buf = bytearray()
        skipping = False  # in a line too long: drop up to its newline
        while not self._stop.is_set() and not self._finishing():
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                return self.reader.header is not None
            buf += data
            start = 0
            while True:
                nl = buf.find(b"\n", start)
                if nl < 0:
                    break
                line = bytes(buf[start : nl + 1])
                start = nl + 1
                if skipping:
                    skipping = False
                    continue
                if self._line(line):
                    return True
            del buf[:start]
            if len(buf) > MAX_LINE_BYTES:
                self._drop(f"a line longer than {MAX_LINE_BYTES} bytes")
                buf.clear()
                skipping = True
        return True

    def _line(self, line: bytes) -> bool:
        """Take one line; True when the node ended its stream."""
        try:
            got = self.reader.accept(line)
        except WireError as err:
            if err.fatal:
                self.ended = f"refused: {err}"
                log.error("node %d datastream: %s", self.node_id, err)
                return True
            self._drop(str(err))
            return False
        if isinstance(got, StreamEnd):
            self.ended = got.reason or "ended"
            return True
        if isinstance(got, Accepted):
            if not self._admit():
                self._drop(f"more than {MAX_FRAMES_PER_S:g} frames a second", quiet=True)
                return False
            self._ds.relay(self.reader.stream, got.channel, got.position, got.payload)
            self.passed += 1
        return False

    def _admit(self) -> bool:
        now = time.monotonic()
        self._tokens = min(BURST_FRAMES, self._tokens + (now - self._refill_at) * MAX_FRAMES_PER_S)
        self._refill_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _drop(self, why: str, *, quiet: bool = False) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._log_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more dropped since the last report)" if self._unlogged else ""
        self._log_at, self._unlogged = now, 0
        (log.info if quiet else log.warning)(
            "node %d datastream: dropped a line: %s%s", self.node_id, why, more
        )

    def _say(self, text: str) -> None:
        if text != self._said:
            self._said = text
            log.warning("%s", text)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)
