"""The TCP delay proxy (benchmarks' edge delay): the delay is applied one way per
direction, a burst is pipelined (not one delay per message), bytes keep their order,
buffering is bounded, and close/half-close/reset travel through it.

Timings are asserted loosely: a lower bound the proxy must respect (the delay is applied
at all), and upper bounds with a wide margin against the serialized behaviour."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests.helpers.waits import wait_until
from tests.node.dataplane.conftest import TOKEN
from workers.node.dataplane import DataPlaneServer, connect_edge, token_in_spec
from workers.node.dataplane.delay_proxy import DelayProxy, front_listener

D = 0.05  # one-way delay of most tests


class Peer:
    """A one-connection TCP server on 127.0.0.1 running ``handle`` in a thread."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.error: BaseException | None = None
        self._handle = handle
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._handle(conn)
        except BaseException as err:
            self.error = err

    def close(self) -> None:
        self._thread.join(10)
        self.listener.close()
        assert not self._thread.is_alive(), "peer thread did not finish"
        if self.error is not None:
            raise self.error


def echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)
    # The end passed on. A connection the proxy closed under it may be gone by now (a
    # loaded host: its reset came first): nothing is left to half-close then, and the
    # test's own asserts say what the client saw.
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def client(proxy: DelayProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


@pytest.fixture
def echo_proxy() -> Iterator[DelayProxy]:
    peer = Peer(echo)
    proxy = DelayProxy("127.0.0.1", peer.port, D)
    try:
        yield proxy
    finally:
        proxy.close()
        peer.close()


def test_round_trip_takes_two_delays(echo_proxy: DelayProxy) -> None:
    with client(echo_proxy) as sock:
        recv_exact_roundtrip = []
        for i in range(3):
            t0 = time.monotonic()
            sock.sendall(b"ping%d" % i)
            assert recv_exact(sock, 5) == b"ping%d" % i
            recv_exact_roundtrip.append(time.monotonic() - t0)
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""  # the echo's EOF came back through the proxy
        writes, mean_late, _ = echo_proxy.lateness()
        assert writes >= 6 and 0 <= mean_late < D  # both ways, and not a delay late
    # Each way is delayed: at least 2 d (a little slack for clock granularity), and not
    # wildly more (a loaded 2-core machine still answers well within a second).
    assert min(recv_exact_roundtrip) >= 2 * D * 0.95, recv_exact_roundtrip
    assert max(recv_exact_roundtrip) < 2 * D + 1.0, recv_exact_roundtrip


def test_zero_delay_passes_through() -> None:
    peer = Peer(echo)
    with DelayProxy("127.0.0.1", peer.port, 0.0) as proxy, client(proxy) as sock:
        sock.sendall(b"hello")
        assert recv_exact(sock, 5) == b"hello"
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""
    peer.close()


def _arrivals(conn: socket.socket, count: int, out: list[float]) -> None:
    """Record when each 8-byte message arrives."""
    buf = b""
    while len(out) < count:
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 8:
            buf = buf[8:]
            out.append(time.monotonic())


def test_back_to_back_messages_are_pipelined() -> None:
    arrivals: list[float] = []
    n = 20
    peer = Peer(lambda conn: _arrivals(conn, n, arrivals))
    with DelayProxy("127.0.0.1", peer.port, D) as proxy, client(proxy) as sock:
        t0 = time.monotonic()
        for i in range(n):
            sock.sendall(i.to_bytes(8, "little"))  # 20 separate sends (TCP_NODELAY)
        peer.close()
    total = arrivals[-1] - t0
    assert len(arrivals) == n
    # Delayed at all: nothing arrives before d. Pipelined: the burst arrives about d after
    # it was sent, not n * d (= 1 s) later; 0.5 s leaves a wide margin for a slow machine.
    assert arrivals[0] - t0 >= D * 0.95
    assert total < n * D / 2, f"{n} messages took {total:.3f} s through a {D} s delay line"


def test_spacing_is_kept_and_each_message_waits_one_delay() -> None:
    """Messages sent 10 ms apart arrive d after each was sent (the line keeps reading
    while earlier messages wait), so the burst ends about d after its last send."""
    arrivals: list[float] = []
    n = 10
    sent: list[float] = []
    peer = Peer(lambda conn: _arrivals(conn, n, arrivals))
    with DelayProxy("127.0.0.1", peer.port, D) as proxy, client(proxy) as sock:
        for i in range(n):
            sent.append(time.monotonic())
            sock.sendall(i.to_bytes(8, "little"))
            time.sleep(0.01)
        peer.close()
    latencies = [a - s for a, s in zip(arrivals, sent, strict=True)]
    assert min(latencies) >= D * 0.95, latencies
    assert sorted(latencies)[n // 2] < 3 * D, latencies  # not growing by d per message
    assert arrivals[-1] - sent[-1] < 0.5


@pytest.mark.parametrize("max_buffer", [4 * 1024 * 1024, 64 * 1024])
def test_bytes_keep_their_order_both_ways(max_buffer: int) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)
    peer = Peer(echo)
    got = bytearray()
    with DelayProxy("127.0.0.1", peer.port, 0.005, max_buffer_bytes=max_buffer) as proxy:
        with client(proxy) as sock:

            def read_all() -> None:
                while chunk := sock.recv(65536):
                    got.extend(chunk)

            reader = threading.Thread(target=read_all)
            reader.start()
            view = memoryview(payload)
            for i in range(0, len(payload), 100_000):  # uneven chunks
                sock.sendall(view[i : i + 100_000])
            sock.shutdown(socket.SHUT_WR)
            reader.join(30)
            assert not reader.is_alive()
    peer.close()
    assert bytes(got) == payload


def test_buffering_is_bounded() -> None:
    """A destination that does not read holds the sender back: the proxy keeps at most
    max_buffer_bytes in its line (the rest waits in kernel buffers or in the sender)."""
    release = threading.Event()
    limit = 256 * 1024

    def stalled(conn: socket.socket) -> None:
        release.wait(10)
        while conn.recv(65536):
            pass

    peer = Peer(stalled)
    with DelayProxy("127.0.0.1", peer.port, 0.001, max_buffer_bytes=limit) as proxy:
        with client(proxy) as sock:
            sock.setblocking(False)
            sent = 0
            chunk = b"x" * 65536
            stalls = 0
            while stalls < 20 and sent < 200 * 1024 * 1024:
                try:
                    sent += sock.send(chunk)
                    stalls = 0
                except BlockingIOError:
                    stalls += 1
                    time.sleep(0.02)
            assert stalls >= 20, "the sender was never held back"
            assert proxy.buffered_bytes <= limit
            release.set()
            sock.setblocking(True)
            sock.shutdown(socket.SHUT_WR)
        peer.close()


def test_half_close_travels_after_the_data() -> None:
    """Client: data, then SHUT_WR. Target: reads it all and the EOF, then answers and
    closes. The EOF arrives after the data, one delay after it was sent."""
    seen: dict[str, float | bytes] = {}

    def handle(conn: socket.socket) -> None:
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        seen["eof_at"] = time.monotonic()
        seen["data"] = data
        conn.sendall(b"answer after eof")

    peer = Peer(handle)
    with DelayProxy("127.0.0.1", peer.port, D) as proxy, client(proxy) as sock:
        sock.sendall(b"request")
        t0 = time.monotonic()
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        t_back = time.monotonic()
    peer.close()
    assert seen["data"] == b"request"
    assert reply == b"answer after eof"
    eof_at = seen["eof_at"]
    assert isinstance(eof_at, float) and eof_at - t0 >= D * 0.95
    assert t_back - t0 >= 2 * D * 0.95


def test_target_reset_closes_the_client() -> None:
    """A target that resets its connection (SO_LINGER 0): the client sees the connection
    end (EOF or reset) after the data sent before it."""

    def reset(conn: socket.socket) -> None:
        conn.sendall(b"last words")
        time.sleep(0.05)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

    peer = Peer(reset)
    with DelayProxy("127.0.0.1", peer.port, D) as proxy, client(proxy) as sock:
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        assert got == b"last words"
    peer.close()


def test_unreachable_target_closes_the_client() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # nothing listens here once closed
    with DelayProxy("127.0.0.1", dead_port, D) as proxy, client(proxy) as sock:
        try:
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass


def test_close_ends_live_connections() -> None:
    peer = Peer(echo)
    proxy = DelayProxy("127.0.0.1", peer.port, D)
    sock = client(proxy)
    sock.sendall(b"in flight")
    wait_until(lambda: proxy.connections == 1, timeout=10, what="the proxy's connection")
    proxy.close()
    proxy.close()  # idempotent
    try:
        rest = sock.recv(65536)
        while rest:
            rest = sock.recv(65536)
    except ConnectionResetError:
        pass
    sock.close()
    peer.close()
    assert proxy.connections == 0


def test_connections_end_by_themselves() -> None:
    peer = Peer(echo)
    with DelayProxy("127.0.0.1", peer.port, 0.01) as proxy:
        with client(proxy) as sock:
            sock.sendall(b"x")
            assert recv_exact(sock, 1) == b"x"
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(1) == b""
        wait_until(lambda: proxy.connections == 0, timeout=10, what="the connection to end")
    peer.close()


def test_an_authenticated_edge_works_through_the_proxy() -> None:
    """The data plane's own handshake and records, through the delay line."""
    spec = token_in_spec(64)
    with (
        DataPlaneServer("127.0.0.1", 0, handshake_timeout_s=2.0) as server,
        DelayProxy("127.0.0.1", server.port, 0.02) as proxy,
    ):
        server.expect(spec, TOKEN)
        t0 = time.monotonic()
        sender = connect_edge("127.0.0.1", proxy.port, spec, TOKEN, timeout=5.0)
        assert time.monotonic() - t0 >= 2 * 0.02 * 0.95  # hello there, answer back
        receiver = server.wait_inbound(spec.edge_id, timeout=5.0)
        with sender, receiver:
            for seq in range(5):
                sender.send(7, seq, (seq + 1).to_bytes(4, "little"))
            for seq in range(5):
                header, payload = receiver.recv(5.0)
                assert (header.object_id, header.sequence) == (7, seq)
                assert int.from_bytes(payload, "little") == seq + 1


def test_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError):
        DelayProxy("127.0.0.1", 1, -0.001)


def test_front_listener_serves_a_wildcard_listener_on_its_own_port() -> None:
    """A node's listener bound to 0.0.0.0 (a container): the proxy listens there too and
    relays to the listener through loopback."""
    spec = token_in_spec(64)
    with (
        DataPlaneServer("0.0.0.0", 0, handshake_timeout_s=2.0) as server,
        front_listener(server.host, server.port, 0.01) as proxy,
    ):
        assert proxy.host == "0.0.0.0" and proxy.port != server.port
        assert proxy.target == ("127.0.0.1", server.port)
        server.expect(spec, TOKEN)
        with connect_edge("127.0.0.1", proxy.port, spec, TOKEN, timeout=5.0) as sender:
            with server.wait_inbound(spec.edge_id, timeout=5.0) as receiver:
                sender.send(1, 0, b"\x01\x00\x00\x00")
                assert receiver.recv(5.0)[0].object_id == 1


def test_edge_delay_knob_is_honoured_only_under_a_harness(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workers.node.config import FaultInjection

    monkeypatch.setenv("MVP_FAULT_EDGE_DELAY_MS", "5")
    monkeypatch.delenv("MVP_TEST_FAULTS_ALLOWED", raising=False)
    assert FaultInjection.from_env().edge_delay_s == 0.0
    monkeypatch.setenv("MVP_TEST_FAULTS_ALLOWED", "1")
    assert FaultInjection.from_env().edge_delay_s == pytest.approx(0.005)
