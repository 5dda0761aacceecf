"""Real TCP edges on 127.0.0.1: round trips, rogue peers, auth, deadlines, groups, latency."""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from mvp_core.models import ActivationDtype
from tests.helpers.waits import wait_until
from tests.node.dataplane.conftest import TOKEN
from workers.node.dataplane import (
    FLAG_ABORT,
    FLAG_BEGIN,
    FLAG_EOS,
    HELLO_MAGIC,
    DataPlaneServer,
    EdgeAuthError,
    EdgeClosed,
    EdgeGroup,
    EdgeReceiver,
    EdgeSender,
    EdgeTimeout,
    RecordError,
    SamplingParams,
    SequenceChecker,
    activation_spec,
    connect_edge,
    decode_activation,
    decode_begin_payload,
    decode_token_out,
    decode_tokens,
    encode_activation,
    encode_begin_payload,
    encode_header,
    encode_tokens,
    token_in_spec,
    token_out_spec,
)
from workers.node.dataplane.receiver import _RECV_BUF
from workers.node.dataplane.records import FORMAT_BLOCK_MAX, HEADER_LEN

MAX_SEQ = 512
HIDDEN = 2048
TOKEN_IN = token_in_spec(MAX_SEQ)
# The edge tests below use float16 activation edges (alignment 2); both formats round trip.
ACT = activation_spec(2, MAX_SEQ, HIDDEN, ActivationDtype.FLOAT16)
ACT3 = activation_spec(3, MAX_SEQ, HIDDEN, ActivationDtype.FLOAT16)
TOKEN_OUT = token_out_spec(4, MAX_SEQ)


def pair(server: DataPlaneServer, spec, token: str = TOKEN) -> tuple[EdgeSender, EdgeReceiver]:
    server.expect(spec, token)
    sender = connect_edge("127.0.0.1", server.port, spec, token, timeout=2.0)
    receiver = server.wait_inbound(spec.edge_id, timeout=2.0)
    return sender, receiver


def rogue(server: DataPlaneServer, edge_id: int, token: str = TOKEN) -> socket.socket:
    """A raw socket that authenticates properly and then writes whatever the test wants."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=2.0)
    tok = token.encode()
    s.sendall(struct.pack("<4sIH", HELLO_MAGIC, edge_id, len(tok)) + tok)
    assert s.recv(3) == b"\x00\x00\x00"
    return s


def raw_header(obj=7, seq=0, extent=8, flags=0, magic=b"MO01", reserved=0) -> bytes:
    return struct.pack("<4sHHQQQII", magic, 1, 40, obj, seq, extent, flags, reserved)


def assert_peer_sees_eof(s: socket.socket, within: float = 1.0) -> None:
    s.settimeout(within)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass


def test_token_records_round_trip(server) -> None:
    sender, receiver = pair(server, TOKEN_IN)
    with sender, receiver:
        params = SamplingParams(request_id=11, max_new_tokens=8, temperature=0.5, seed=3)
        sender.send(11, 0, encode_begin_payload(params, [1, 2, 3, 4]), FLAG_BEGIN)
        sender.send(11, 1, encode_tokens([9]))
        sender.send(11, 2, encode_tokens([10]), FLAG_EOS)
        hdr, payload = receiver.recv(2.0)
        assert (hdr.object_id, hdr.sequence, hdr.begin, hdr.eos) == (11, 0, True, False)
        got_params, prompt = decode_begin_payload(payload)
        assert prompt == [1, 2, 3, 4] and got_params.seed == 3 and got_params.request_id == 11
        hdr, payload = receiver.recv(2.0)
        assert (hdr.sequence, decode_tokens(payload)) == (1, [9])
        hdr, payload = receiver.recv(2.0)
        assert (hdr.sequence, hdr.eos, decode_tokens(payload)) == (2, True, [10])


def test_token_out_and_sequence_checker(server) -> None:
    sender, receiver = pair(server, TOKEN_OUT)
    with sender, receiver:
        for seq, tok in enumerate([5, 6, 2]):
            sender.send(3, seq, struct.pack("<I", tok), FLAG_EOS if tok == 2 else 0)
        chk = SequenceChecker()
        got = []
        while True:
            hdr, payload = receiver.recv(2.0)
            chk.check(hdr.sequence)
            got.append(decode_token_out(payload))
            if hdr.eos:
                break
        assert got == [5, 6, 2]


@pytest.mark.parametrize("dtype", list(ActivationDtype), ids=lambda d: d.value)
def test_activation_records_round_trip(server, dtype: ActivationDtype) -> None:
    spec = activation_spec(2, MAX_SEQ, HIDDEN, dtype)
    # A full context's rows, and the response format a first record may carry (DECISIONS 89).
    rows = MAX_SEQ * HIDDEN * spec.alignment
    assert spec.alignment == dtype.itemsize and spec.max_extent == rows + FORMAT_BLOCK_MAX
    sender, receiver = pair(server, spec)
    rng = np.random.default_rng(0)
    np_type = np.float32 if dtype is ActivationDtype.FLOAT32 else np.float16
    small = rng.standard_normal((3, HIDDEN)).astype(np_type)
    full = rng.standard_normal((MAX_SEQ, HIDDEN)).astype(np_type)  # 2-4 MiB: many reads
    with sender, receiver:
        got: list[np.ndarray] = []

        def consume() -> None:
            for _ in range(3):
                _hdr, payload = receiver.recv(5.0)
                got.append(decode_activation(payload, HIDDEN, dtype) if payload else np.empty(0))

        t = threading.Thread(target=consume)
        t.start()
        sender.send(1, 0, encode_activation(full), FLAG_BEGIN)
        sender.send(1, 1, encode_activation(small))
        sender.send(1, 2, b"", FLAG_ABORT)
        t.join(5)
        assert np.array_equal(got[0], full) and np.array_equal(got[1], small)
        assert got[2].size == 0


ROGUE_CASES = {
    "bad_magic": ([raw_header(magic=b"BAD!")], "bad magic b'BAD!' (expected b'MO01')"),
    "oversized": (
        [raw_header(extent=MAX_SEQ * HIDDEN * 2 + FORMAT_BLOCK_MAX + 2)],
        "exceeds the edge's max extent",
    ),
    "unaligned": ([raw_header(extent=7)], "extent 7 is not a multiple of alignment 2"),
    "unknown_flags": ([raw_header(flags=0x40)], "unknown flag bits 0x40"),
    "reserved": ([raw_header(reserved=1)], "non-zero reserved field 0x00000001"),
    "out_of_order": (
        [raw_header(seq=0, flags=FLAG_BEGIN) + b"\0" * 8, raw_header(seq=2)],
        "out-of-order record for object 7: expected sequence 1, got 2",
    ),
}


@pytest.mark.parametrize("case", list(ROGUE_CASES))
def test_rogue_peer_bad_record(server, caplog, case: str) -> None:
    frames, message = ROGUE_CASES[case]
    server.expect(ACT, TOKEN)
    bad = rogue(server, ACT.edge_id)
    receiver = server.wait_inbound(ACT.edge_id, 2.0)
    try:
        bad.sendall(b"".join(frames))
        with caplog.at_level(logging.WARNING, logger="mvp.dataplane"):
            if case == "out_of_order":
                receiver.recv(2.0)
            with pytest.raises(RecordError) as info:
                receiver.recv(2.0)
        assert message in str(info.value)
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any(
            m.startswith("edge 2: ") and message in m and "from 127.0.0.1:" in m for m in logged
        ), logged
        assert receiver.closed
        assert_peer_sees_eof(bad)
        with pytest.raises(EdgeClosed):
            receiver.recv(0.1)
    finally:
        bad.close()
    # The server keeps serving well-formed peers.
    sender, good = pair(server, ACT3)
    with sender, good:
        sender.send(1, 0, b"\0\0", FLAG_BEGIN)
        assert good.recv(2.0)[0].sequence == 0


def test_wrong_token_rejected_and_logged(server, caplog) -> None:
    server.expect(ACT, TOKEN)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mvp.dataplane"):
        with pytest.raises(EdgeAuthError, match="authentication failed: wrong edge token"):
            connect_edge("127.0.0.1", server.port, ACT, "not-the-token", timeout=2.0)
    assert time.monotonic() - t0 < 1.0  # no retries on a wrong token
    msgs = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("edge 2: authentication failed: wrong edge token from 127.0.0.1:")
        for m in msgs
    ), msgs
    # The expectation is still open for the rightful peer.
    sender = connect_edge("127.0.0.1", server.port, ACT, TOKEN, timeout=2.0)
    receiver = server.wait_inbound(2, 2.0)
    sender.close()
    receiver.close()


def test_unknown_edge_rejected_and_logged(server, caplog) -> None:
    server.expect(ACT, TOKEN)  # a provisioned stage: it knows which edges it expects
    with caplog.at_level(logging.WARNING, logger="mvp.dataplane"):
        # Held hold_unexpected_s (0.5 s) for the edge to become expected, then sent away.
        with pytest.raises(EdgeTimeout, match="edge 9 not expected by this node"):
            connect_edge("127.0.0.1", server.port, activation_spec(9, 4, 4), TOKEN, timeout=0.8)
    msgs = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("edge 9: rejected connection from 127.0.0.1:")
        and m.endswith("edge not expected by this node")
        for m in msgs
    ), msgs
    sender = connect_edge("127.0.0.1", server.port, ACT, TOKEN, timeout=2.0)
    receiver = server.wait_inbound(ACT.edge_id, timeout=2.0)
    sender.close()
    receiver.close()


def test_an_upstream_early_for_a_loading_stage_is_quiet_and_accepted(server, caplog) -> None:
    """Start-up order: the upstream loaded first and knocks while this node expects
    nothing yet; it retries without a warning here and is accepted once expected."""

    def early() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage().startswith("edge 2: 127.0.0.1:")]

    with caplog.at_level(logging.DEBUG, logger="mvp.dataplane"):
        with ThreadPoolExecutor(1) as pool:
            upstream = pool.submit(connect_edge, "127.0.0.1", server.port, ACT, TOKEN, 30.0)
            wait_until(lambda: len(early()) >= 2, timeout=30, what="the upstream refused twice")
            receiver_future = server.expect(ACT, TOKEN)  # the stage has loaded
            sender = upstream.result(30)
        receiver = receiver_future.result(30)
    sender.close()
    receiver.close()
    assert len(early()) >= 2 and all(r.levelno == logging.DEBUG for r in early()), early()
    assert "expects no edge yet" in early()[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_bad_hello_and_duplicate_edge(server, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="mvp.dataplane"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=2.0) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert s.recv(3)[:1] == b"\x02"
            assert_peer_sees_eof(s)
        sender, receiver = pair(server, ACT)
        with pytest.raises(EdgeAuthError, match="edge 2 already connected"):
            connect_edge("127.0.0.1", server.port, ACT, TOKEN, timeout=1.0)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("bad hello magic b'GET '" in m for m in msgs), msgs
    sender.close()
    receiver.close()


def test_connect_retries_until_expected(server) -> None:
    result: list[EdgeSender] = []
    t = threading.Thread(
        target=lambda: result.append(
            connect_edge("127.0.0.1", server.port, ACT, TOKEN, timeout=3.0)
        )
    )
    t.start()
    time.sleep(0.3)  # the upstream's hello is held, not sent away to poll
    expected_at = time.monotonic()
    server.expect(ACT, TOKEN)
    receiver = server.wait_inbound(2, 3.0)
    assert time.monotonic() - expected_at < 0.1
    t.join(3)
    sender = result[0]
    with sender, receiver:
        sender.send(1, 0, b"\1\0", FLAG_BEGIN)
        assert bytes(receiver.recv(2.0)[1]) == b"\1\0"


def test_wait_inbound_timeout_and_server_close() -> None:
    srv = DataPlaneServer()
    fut = srv.expect(ACT, TOKEN)
    with pytest.raises(EdgeTimeout, match=r"no authenticated inbound connection within 0\.05 s"):
        srv.wait_inbound(2, 0.05)
    srv.close()
    with pytest.raises(EdgeClosed, match="server closed"):
        fut.result(1)


def test_read_deadline(server) -> None:
    sender, receiver = pair(server, ACT)
    with sender, receiver:
        t0 = time.monotonic()
        with pytest.raises(EdgeTimeout) as info:
            receiver.recv(0.1)
        elapsed = time.monotonic() - t0
        assert 0.09 <= elapsed < 1.0 and not info.value.partial
        # A clean timeout leaves the edge usable.
        sender.send(1, 0, b"\0\0", FLAG_BEGIN)
        assert receiver.recv(1.0)[0].sequence == 0


def test_read_deadline_mid_record_breaks_edge(server) -> None:
    server.expect(ACT, TOKEN)
    bad = rogue(server, ACT.edge_id)
    receiver = server.wait_inbound(2, 2.0)
    try:
        bad.sendall(raw_header(extent=8, flags=FLAG_BEGIN) + b"\0\0")  # payload short by 6
        with pytest.raises(EdgeTimeout) as info:
            receiver.recv(0.1, rest_s=0.1)
        assert info.value.partial and receiver.closed
        with pytest.raises(EdgeClosed):
            receiver.recv(0.1)
        assert_peer_sees_eof(bad)
    finally:
        bad.close()


@pytest.mark.parametrize("split", [10, 40 + 3], ids=["in-the-header", "in-the-payload"])
def test_a_record_that_starts_at_the_end_of_an_idle_wait_gets_its_rest_s(
    server, split: int
) -> None:
    """A busy run's stage broke its edge: its idle wait (1 s) ended while a record was
    half-read ("read deadline missed in the middle of a record"). The idle timeout is for
    a record to begin; once it has, the rest has ``rest_s``."""
    server.expect(ACT, TOKEN)
    peer = rogue(server, ACT.edge_id)
    receiver = server.wait_inbound(2, 2.0)
    record = raw_header(extent=8, flags=FLAG_BEGIN) + b"\1\2\3\4\5\6\7\x08"
    try:
        peer.sendall(record[:split])
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.append(receiver.recv(0.2, rest_s=30.0)))
        reader.start()
        time.sleep(0.6)  # past the idle wait: the record began within it
        peer.sendall(record[split:])
        reader.join(30)
        assert got, "the record was not read"
        header, payload = got[0]
        assert header.extent == 8 and bytes(payload) == b"\1\2\3\4\5\6\7\x08"
        assert not receiver.closed
    finally:
        peer.close()


def _queued(receiver: EdgeReceiver) -> int:
    """Bytes waiting in the receiver's socket, not read yet."""
    return int(struct.unpack("i", fcntl.ioctl(receiver.fileno(), termios.FIONREAD, b"\0" * 4))[0])


@pytest.mark.parametrize("tail", [2, 20, 38])
def test_a_header_split_by_the_end_of_the_receive_buffer_keeps_the_record_boundaries(
    server, tail: int
) -> None:
    """A 2-stage run at 64 streams broke edge 2 with "bad magic b'\\x18t,\\xc0'": the
    receiver's buffer filled to its end with the first ``tail`` bytes of a header, the
    next read compacted it (those bytes to its start), and the caller's ``_end +=`` of
    the read's count undid that: the buffer's end stayed past what it held, and the
    records after it were read from a stale payload's bytes."""
    sender, receiver = pair(server, ACT)
    with sender, receiver:
        stale = b"\x18t,\xc0" * ((_RECV_BUF - tail - HEADER_LEN) // 4)  # fills the buffer
        stale += b"\x18t,\xc0"[: _RECV_BUF - tail - HEADER_LEN - len(stale)]
        sender.send(1, 0, stale)
        sender.send(2, 0, b"B" * 8)
        sender.send(3, 0, b"C" * 8)
        # All of it waits in the socket: the first read fills the buffer to its end.
        wait_until(
            lambda: _queued(receiver) >= 3 * HEADER_LEN + len(stale) + 16,
            timeout=5.0,
            what="the records queued at the receiver",
        )
        header, payload = receiver.recv(2.0)
        assert (header.object_id, bytes(payload)) == (1, stale)
        assert _queued(receiver) == HEADER_LEN - tail + 8 + HEADER_LEN + 8
        for obj, body in ((2, b"B" * 8), (3, b"C" * 8)):
            header, payload = receiver.recv(2.0)
            assert (header.object_id, header.extent, bytes(payload)) == (obj, 8, body)
        sender.send(4, 0, b"D" * 8)  # sent after the others were read: nothing stale
        header, payload = receiver.recv(2.0)
        assert (header.object_id, bytes(payload)) == (4, b"D" * 8)
        assert receiver.bytes == sender.bytes


def _stage(server: DataPlaneServer, down: DataPlaneServer):
    """Upstream U -> [R  stage  S] -> downstream D, with R and S in one EdgeGroup."""
    u, r = pair(server, ACT)
    s, d = pair(down, ACT3)
    group = EdgeGroup("stage 1")
    group.add(r)
    group.add(s)
    return u, r, s, d, group


def test_group_upstream_eof_reaches_downstream_fast(server) -> None:
    down = DataPlaneServer()
    u, r, s, d, group = _stage(server, down)
    errors: list[BaseException] = []

    def stage_loop() -> None:
        try:
            while True:
                hdr, payload = r.recv(5.0)
                s.send(hdr.object_id, hdr.sequence, payload, hdr.flags)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=stage_loop)
    t.start()
    try:
        u.send(1, 0, b"\0\0", FLAG_BEGIN)
        assert d.recv(2.0)[0].sequence == 0
        t0 = time.perf_counter()
        u.close()  # the upstream goes away ...
        with pytest.raises(
            EdgeClosed, match=r"edge 3: peer 127\.0\.0\.1:\d+ closed the connection"
        ):
            d.recv(2.0)  # ... and the downstream of the stage sees EOF promptly
        dt = time.perf_counter() - t0
        print(f"\nupstream close -> downstream EOF through one stage: {dt * 1e3:.2f} ms")
        assert dt < 0.5
        t.join(2)
        assert group.failed and isinstance(group.first_error, EdgeClosed)
        assert "edge 2" in str(group.first_error) and s.closed
    finally:
        group.close()
        d.close()
        down.close()


def test_group_downstream_close_reaches_upstream_fast(server) -> None:
    down = DataPlaneServer()
    u, r, _s, d, group = _stage(server, down)
    try:
        t0 = time.perf_counter()
        d.close()
        assert group.wait_failed(1.0)
        # Fast is the behaviour under test: within a second.
        wait_until(u.peer_closed, timeout=1.0, what="the upstream to see EOF", interval=0.001)
        print(f"\ndownstream close -> upstream sees EOF: {(time.perf_counter() - t0) * 1e3:.2f} ms")
        assert "edge 3: downstream" in str(group.first_error)
        assert r.closed
        with pytest.raises(EdgeClosed):
            u.send(1, 0, b"\0\0", FLAG_BEGIN, timeout_s=0.5)
            u.send(1, 1, b"\0\0", 0, timeout_s=0.5)
    finally:
        group.close()
        u.close()
        down.close()


def test_group_guard_engine_crash(server) -> None:
    down = DataPlaneServer()
    u, r, s, d, group = _stage(server, down)
    try:
        with pytest.raises(RuntimeError), group.guard():
            raise RuntimeError("engine crashed")
        assert str(group.first_error) == "engine crashed"
        assert r.closed and s.closed
        with pytest.raises(EdgeClosed):
            d.recv(1.0)
    finally:
        group.close()
        u.close()
        d.close()
        down.close()


def test_sender_validates_before_sending(server) -> None:
    sender, receiver = pair(server, ACT)
    with sender, receiver:
        with pytest.raises(RecordError, match="not a multiple of alignment 2"):
            sender.send(1, 0, b"\0\0\0", FLAG_BEGIN)
        assert encode_header(1, 0, 2, FLAG_BEGIN)  # nothing was sent; the edge is fine
        sender.send(1, 0, b"\0\0", FLAG_BEGIN)
        assert receiver.recv(1.0)[0].extent == 2


def _ping_pong(spec_out, spec_back, payload: bytes, n: int) -> np.ndarray:
    """Driver -> stage on `spec_out`, stage echoes on `spec_back`; returns round trips (s)."""
    driver_srv, stage_srv = DataPlaneServer(), DataPlaneServer()
    try:
        out, stage_in = pair(stage_srv, spec_out)
        stage_out, back = pair(driver_srv, spec_back)

        def stage() -> None:
            for _ in range(n):
                hdr, data = stage_in.recv(5.0)
                stage_out.send(hdr.object_id, hdr.sequence, data, hdr.flags)

        t = threading.Thread(target=stage)
        t.start()
        samples = []
        chk = SequenceChecker()
        for seq in range(n):
            t0 = time.perf_counter()
            out.send(1, seq, payload)
            hdr, _ = back.recv(5.0)
            samples.append(time.perf_counter() - t0)
            chk.check(hdr.sequence)
        t.join(5)
        for e in (out, stage_in, stage_out, back):
            e.close()
        return np.array(samples[n // 20 :])
    finally:
        driver_srv.close()
        stage_srv.close()


def test_loopback_ping_pong_latency() -> None:
    """Printed, not asserted: the machine is shared, numbers are indicative only."""
    tok = _ping_pong(TOKEN_IN, TOKEN_OUT, struct.pack("<I", 42), 2000) * 1e6
    row = np.zeros((1, HIDDEN), dtype=np.float16).tobytes()
    act = _ping_pong(ACT, ACT3, row, 1000) * 1e6
    for name, us in (("1-token record", tok), (f"[1, {HIDDEN}] f16 activation", act)):
        print(
            f"\nloopback round trip ({name}, {len(us)} samples): "
            f"p50 {np.percentile(us, 50):.1f} us, p95 {np.percentile(us, 95):.1f} us, "
            f"p99 {np.percentile(us, 99):.1f} us",
            file=sys.stderr,
        )


def test_no_torch_import() -> None:
    code = "import sys, workers.node.dataplane; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0


def test_stalled_hello_does_not_block_others() -> None:
    srv = DataPlaneServer(handshake_timeout_s=5.0)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=2.0) as idle:
            sender, receiver = pair(srv, ACT)  # served while `idle` never says hello
            with sender, receiver:
                sender.send(1, 0, b"\0\0", FLAG_BEGIN)
                assert receiver.recv(1.0)[0].extent == 2
            t0 = time.monotonic()
            srv.close()  # does not wait out the idle peer's handshake deadline
            assert time.monotonic() - t0 < 1.0
            assert_peer_sees_eof(idle)
    finally:
        srv.close()
