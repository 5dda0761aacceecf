"""A node's data-plane listener (`DataPlaneServer`, from boot: DECISIONS 6): it
authenticates inbound edges and hands each to the stage that expects it.

A hello for an edge not expected yet is held up to `hold_unexpected_s` before the retry
answer, so an upstream that connects early is accepted as soon as the edge is expected.
A node that expects no edge yet (its stage still loading) refuses such hellos quietly:
that is the start-up order of a pipeline. Once it expects edges, a hello for another
edge is logged as a warning. A hello on the text-stream edge id goes to the text stream
(textserve.py), one on the node-datastream edge id to the node's own datastream
(streamserve.py, DECISIONS 93).
"""

from __future__ import annotations

import hmac
import selectors
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from mvp_core.edge_auth import (
    ANSWER_REJECT,
    ANSWER_RETRY,
    NODE_DATASTREAM_EDGE_ID,
    TEXT_STREAM_EDGE_ID,
)

from .endpoint import log
from .errors import EdgeClosed, EdgeTimeout
from .handshake import answer, answer_ok, read_hello
from .receiver import EdgeReceiver
from .records import EdgeSpec
from .sockets import Closing, Wakeup, hard_close
from .streamserve import DatastreamGate, DatastreamHandler
from .textserve import TextHandler, TextStreamGate

__all__ = ["DataPlaneServer"]


class _Expectation:
    __slots__ = ("check_order", "future", "spec", "token")

    def __init__(self, spec: EdgeSpec, token: bytes, check_order: bool) -> None:
        self.spec = spec
        self.token = token
        self.check_order = check_order
        self.future: Future[EdgeReceiver] = Future()


class DataPlaneServer(Closing):
    """A node's data-plane listener: authenticates inbound edges and hands them out.

    Listens from construction (nodes advertise the port before they know their edges);
    connections for edges not `expect`ed yet are told to retry.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        handshake_timeout_s: float = 5.0,
        hold_unexpected_s: float = 0.5,
    ) -> None:
        self.handshake_timeout_s = handshake_timeout_s
        # A hello for an edge not expected yet (its stage is still loading) is held this
        # long for the expectation to appear, instead of being sent away to poll: the
        # upstream connects the moment the stage expects it.
        self.hold_unexpected_s = hold_unexpected_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an edge became expected, or closing
        self._expected: dict[int, _Expectation] = {}
        self._futures: dict[int, Future[EdgeReceiver]] = {}
        self._connected: set[int] = set()
        # Until its stage is provisioned a node expects nothing: an upstream that loaded
        # first knocks, is held, and retries (the start-up order, quiet); once it expects
        # edges, a hello for another one is a real misroute (a warning).
        self._expects_any = False
        self._tokens: dict[int, bytes] = {}  # kept after connection: later peers still authenticate
        self._receivers: list[EdgeReceiver] = []
        self._handshaking: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._text = TextStreamGate()  # the head node's text stream (serve_text)
        self._datastream = DatastreamGate()  # the node's own datastream (serve_datastream)
        self._closing = False
        self._listener = socket.create_server((host, port), backlog=16)
        self._wakeup = Wakeup()
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"dataplane-accept-{self.port}", daemon=True
        )
        self._accept_thread.start()

    # -- public API

    def expect(
        self, spec: EdgeSpec, token: str | bytes, *, check_order: bool = True
    ) -> Future[EdgeReceiver]:
        """Admit one connection for `spec.edge_id` carrying `token`."""
        token_b = token.encode() if isinstance(token, str) else token
        if not token_b:
            raise ValueError("edge token must not be empty")
        exp = _Expectation(spec, token_b, check_order)
        with self._lock:
            if self._closing:
                raise EdgeClosed("data-plane server is closed")
            if spec.edge_id in self._expected:
                raise ValueError(f"edge {spec.edge_id} is already expected")
            self._connected.discard(spec.edge_id)
            self._expected[spec.edge_id] = exp
            self._expects_any = True
            self._tokens[spec.edge_id] = token_b
            self._futures[spec.edge_id] = exp.future
            self._changed.notify_all()
        return exp.future

    def wait_inbound(self, edge_id: int, timeout: float) -> EdgeReceiver:
        with self._lock:
            fut = self._futures.get(edge_id)
        if fut is None:
            raise ValueError(f"edge {edge_id} was never expected")
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise EdgeTimeout(
                f"edge {edge_id}: no authenticated inbound connection within {timeout} s"
            ) from None

    def serve_text(self, token: str, handler: TextHandler) -> None:
        """Hand every connection that authenticates with ``token`` on the text-stream edge
        id (mvp_core.edge_auth) to ``handler(sock, peer, False)``, and one that shows
        TEXT_READER_TOKEN to ``handler(sock, peer, True)`` (a keyed reader: the handler
        checks its prompt's key), in its own thread; the socket is closed when the handler
        returns or the server closes."""
        self._text.serve(token, handler)

    def serve_datastream(self, token: str, handler: DatastreamHandler) -> None:
        """Hand every connection that authenticates with ``token`` on the node-datastream
        edge id (mvp_core.edge_auth) to ``handler(sock, peer)`` in its own thread; the
        socket is closed when the handler returns or the server closes."""
        self._datastream.serve(token, handler)

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._changed.notify_all()
            pending = list(self._expected.values())
            self._expected.clear()
            receivers = list(self._receivers)
            self._receivers.clear()
            handshaking = list(self._handshaking)
        self._wakeup.wake()
        self._accept_thread.join()
        for sock in handshaking:
            hard_close(sock)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(self.handshake_timeout_s + 1)
        for exp in pending:
            if not exp.future.done():
                exp.future.set_exception(EdgeClosed(f"edge {exp.spec.edge_id}: server closed"))
        for r in receivers:
            r.close()
        self._listener.close()
        self._wakeup.close()

    # -- internals

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wakeup.reader, selectors.EVENT_READ)
        try:
            while not self._closing:
                for key, _ in sel.select():
                    if key.fileobj is self._wakeup.reader or self._closing:
                        return
                    try:
                        sock, addr = self._listener.accept()
                    except OSError as e:
                        log.warning("data plane: accept failed: %s", e)
                        continue
                    t = threading.Thread(
                        target=self._handshake,
                        args=(sock, f"{addr[0]}:{addr[1]}"),
                        name=f"dataplane-hello-{addr[1]}",
                        daemon=True,
                    )
                    with self._lock:
                        if self._closing:
                            hard_close(sock)
                            return
                        self._handshaking.add(sock)
                        self._threads.add(t)
                    t.start()
        finally:
            sel.close()

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        handed = False
        try:
            handed = self._handshake_inner(sock, peer)
        except Exception:  # never let a handshake thread die silently
            log.exception("data plane: handshake with %s crashed", peer)
        finally:
            with self._lock:
                self._handshaking.discard(sock)
                self._threads.discard(threading.current_thread())
            if not handed:
                hard_close(sock)

    def _handshake_inner(self, sock: socket.socket, peer: str) -> bool:
        deadline = time.monotonic() + self.handshake_timeout_s
        hello = read_hello(sock, peer, deadline, lambda: self._closing)
        if hello is None:
            return False
        edge_id, token = hello
        if edge_id == TEXT_STREAM_EDGE_ID:
            return self._text.handle(sock, peer, token)
        if edge_id == NODE_DATASTREAM_EDGE_ID:
            return self._datastream.handle(sock, peer, token)
        exp = self._admit(sock, peer, edge_id, token, deadline)
        if exp is None:
            return False
        return self._hand_over(sock, peer, exp)

    def _admit(
        self, sock: socket.socket, peer: str, edge_id: int, token: bytes, deadline: float
    ) -> _Expectation | None:
        """The expectation this hello meets (now connected), or None: refused, answered
        and logged (a wrong token, an edge already connected, one not expected)."""
        with self._lock:
            self._changed.wait_for(
                lambda: edge_id in self._expected or edge_id in self._connected or self._closing,
                timeout=max(0.0, min(self.hold_unexpected_s, deadline - time.monotonic())),
            )
            exp = self._expected.get(edge_id)
            expects_any = self._expects_any
            connected = edge_id in self._connected
            known = self._tokens.get(edge_id)
            if exp is not None and hmac.compare_digest(token, exp.token):
                del self._expected[edge_id]
                self._connected.add(edge_id)
                return exp
        if exp is not None or (
            connected and known is not None and not hmac.compare_digest(token, known)
        ):
            log.error("edge %d: authentication failed: wrong edge token from %s", edge_id, peer)
            answer(sock, ANSWER_REJECT, "authentication failed: wrong edge token")
        elif connected:
            log.warning(
                "edge %d: rejected connection from %s: edge already connected",
                edge_id,
                peer,
            )
            answer(sock, ANSWER_REJECT, f"edge {edge_id} already connected")
        else:
            if expects_any:
                log.warning(
                    "edge %d: rejected connection from %s: edge not expected by this node",
                    edge_id,
                    peer,
                )
            else:
                log.debug(
                    "edge %d: %s is early: this node expects no edge yet (its stage is "
                    "loading); it retries",
                    edge_id,
                    peer,
                )
            answer(sock, ANSWER_RETRY, f"edge {edge_id} not expected by this node")
        return None

    def _hand_over(self, sock: socket.socket, peer: str, exp: _Expectation) -> bool:
        """Accept the edge and hand its receiver to the stage that expects it."""
        edge_id = exp.spec.edge_id
        try:
            sock.settimeout(self.handshake_timeout_s)
            answer_ok(sock)
        except OSError as e:
            log.warning("edge %d: lost %s while accepting it: %s", edge_id, peer, e)
            with self._lock:
                self._connected.discard(edge_id)
                if not self._closing:
                    self._expected[edge_id] = exp
            return False
        sock.settimeout(None)
        receiver = EdgeReceiver(sock, exp.spec, peer, check_order=exp.check_order)
        with self._lock:
            closing = self._closing
            if not closing:
                self._receivers.append(receiver)
        if closing:
            if not exp.future.done():
                exp.future.set_exception(EdgeClosed(f"edge {edge_id}: server closed"))
            return False
        log.info("edge %d: accepted authenticated upstream %s", edge_id, peer)
        if not exp.future.set_running_or_notify_cancel():
            receiver.close()
            return True
        exp.future.set_result(receiver)
        return True
