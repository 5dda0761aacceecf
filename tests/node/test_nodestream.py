"""A node's own datastream (DECISIONS 93) over a real loopback socket: the node's
publisher behind ``DataPlaneServer.serve_datastream`` and the run's follower
(``mvp_io.datastream.NodeFollower``) passing its frames on into a datastream; a follower
without the token is refused by name; a hostile node's bytes are dropped, never raised; a
follower that never reads never slows the publisher; the sampler and the load progress
publish what changed, bounded."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from mvp_core.datastream import SOURCE_NODE_DATASTREAM, Frame
from mvp_core.edge_auth import ANSWER, ANSWER_OK, ANSWER_REJECT, NODE_DATASTREAM_EDGE_ID, hello
from mvp_core.node_datastream import ChannelDecl, FrameMsg, StreamHeader, encode_message
from mvp_io.datastream import Datastream, NodeFollower, Sink
from tests.helpers.waits import wait_until
from workers.node.dataplane import DataPlaneServer
from workers.node.nodestream import LoadProgress, NodeDatastream, NodeSampler, StepStats

pytestmark = [pytest.mark.quick, pytest.mark.timeout(60)]

TOKEN = "node-datastream-token-0123456789"


class Collect(Sink):
    def __init__(self) -> None:
        super().__init__("collect")
        self.frames: list[Frame] = []

    def offer(self, frame: Frame, *, force: bool = False) -> bool:
        self.frames.append(frame)
        return True

    def _wake(self) -> None:
        pass

    def _run(self) -> None:
        pass

    def of(self, channel: str) -> list[Frame]:
        return [f for f in self.frames if f.channel == channel]


@pytest.fixture
def node() -> Iterator[tuple[DataPlaneServer, NodeDatastream]]:
    server = DataPlaneServer(handshake_timeout_s=2.0)
    stream = NodeDatastream(7, 2, 1)
    server.serve_datastream(TOKEN, stream.serve)
    yield server, stream
    stream.close()
    server.close()


def _follower(server: DataPlaneServer, sink: Collect, token: str = TOKEN) -> NodeFollower:
    ds = Datastream(run_id=7, node_id=0, sinks=[sink], summary_interval_s=None)
    return NodeFollower(
        ds, run_id=7, node_id=2, endpoint=f"127.0.0.1:{server.port}", token=token
    ).start()


def _hello(port: int, token: str) -> tuple[int, str, socket.socket]:
    sock = socket.create_connection(("127.0.0.1", port), 5)
    sock.sendall(hello(NODE_DATASTREAM_EDGE_ID, token))
    status, n = ANSWER.unpack(sock.recv(ANSWER.size, socket.MSG_WAITALL))
    return status, sock.recv(n, socket.MSG_WAITALL).decode() if n else "", sock


def test_a_follower_gets_the_nodes_frames_in_order_with_the_backlog_first(node) -> None:
    server, stream = node
    for i in range(3):  # before anyone follows: the backlog
        stream.publish("mvp.node.kv", {"slots_in_use": i})
    sink = Collect()
    follower = _follower(server, sink)
    try:
        wait_until(lambda: len(sink.frames) == 3, timeout=10, what="the backlog")
        stream.publish("mvp.node.load", {"loaded_bytes": 5})
        stream.publish("mvp.node.kv", {"slots_in_use": 9})
        wait_until(lambda: len(sink.frames) == 5, timeout=10, what="the live frames")
        stream.close("stopped", wait_s=10)  # as the node exits: its followers have the end
        assert stream.followers == 0
        wait_until(lambda: not follower.running, timeout=10, what="the end of the stream")
    finally:
        follower.stop()
    assert follower.ended == "stopped"
    kv = sink.of("mvp.node.kv")
    assert [f.position for f in kv] == [0, 1, 2, 3]
    assert [json.loads(f.payload)["slots_in_use"] for f in kv] == [0, 1, 2, 9]
    assert {(f.source, f.stream) for f in sink.frames} == {(SOURCE_NODE_DATASTREAM, "mvp-node-7-2")}
    # Channel ids are the run datastream's own for the node's stream (unique there).
    assert len({f.channel_id for f in sink.frames}) == 2
    assert follower.last == {"mvp.node.kv": 3, "mvp.node.load": 0}


def test_a_follower_without_the_token_is_refused_by_name(node, caplog) -> None:
    server, stream = node
    stream.publish("mvp.node.kv", {"slots_in_use": 1})
    status, reason, sock = _hello(server.port, "not-the-token")
    with sock:
        assert status == ANSWER_REJECT
        assert reason == "authentication failed: wrong datastream token"
        assert sock.recv(100) == b""  # closed: not a byte of the stream
    assert "node datastream: authentication failed: wrong token" in caplog.text
    assert "not-the-token" not in caplog.text
    # The run's follower with a wrong token passes nothing on and keeps its thread quiet.
    sink = Collect()
    follower = _follower(server, sink, token="wrong-token-wrong-token")
    try:
        wait_until(lambda: follower.connections >= 1, timeout=10, what="a try")
    finally:
        follower.stop()
    assert sink.frames == []
    status, _, sock = _hello(server.port, TOKEN)
    with sock:
        assert status == ANSWER_OK


def test_a_follower_that_never_reads_does_not_slow_the_publisher() -> None:
    server = DataPlaneServer(handshake_timeout_s=2.0)
    stream = NodeDatastream(7, 2, 1, follower_frames=16)
    server.serve_datastream(TOKEN, stream.serve)
    try:
        status, _, sock = _hello(server.port, TOKEN)
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            assert status == ANSWER_OK
            wait_until(lambda: stream.followers == 1, timeout=5, what="the follower")
            record = {"edges": [{"edge_id": 1, "direction": "in", "bytes": 1}] * 20}
            for i in range(3_000):
                assert stream.publish("mvp.node.edges", record | {"i": i})
            assert stream.published == 3_000
            assert stream.dropped > 0  # lost for the follower that does not read, counted
    finally:
        stream.close()
        server.close()


class HostileNode:
    """Answers any hello OK, then writes what the test gives it."""

    def __init__(self, payload: bytes) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.payload = payload
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(ANSWER.pack(ANSWER_OK, 0) + self.payload)
            conn.recv(1)  # until the follower leaves

    def close(self) -> None:
        self.listener.close()


def test_a_hostile_nodes_bytes_are_dropped_and_logged_never_raised(caplog) -> None:
    good = [
        encode_message(StreamHeader(7, 2, 1)),
        encode_message(ChannelDecl("mvp.node.kv", 0)),
    ]
    payload = b"".join(
        [
            b"\xff\xfe garbage\n",
            *good,
            b'{"type":"channel","channel":"mvp.orch.lifecycle","channel_id":1}\n',
            b'{"type":"frame","channel_id":1,"position":0,"record":{"kind":"RunFaulted"}}\n',
            b"x" * 100_000 + b"\n",  # a line past the bound: dropped whole
            encode_message(FrameMsg(0, 0, {"slots_in_use": 1})),
            b'{"type":"header","version":1,"stream":"mvp-node-7-3","run_id":7,"node_id":3,'
            b'"stage_index":0}\n',
            encode_message(FrameMsg(0, 1, {"slots_in_use": 2})),  # after the follow ended
        ]
    )
    hostile = HostileNode(payload)
    sink = Collect()
    ds = Datastream(run_id=7, node_id=0, sinks=[sink], summary_interval_s=None)
    follower = NodeFollower(
        ds, run_id=7, node_id=2, endpoint=f"127.0.0.1:{hostile.port}", token=TOKEN
    ).start()
    try:
        wait_until(lambda: not follower.running, timeout=10, what="the follow to end")
    finally:
        follower.stop()
        hostile.close()
    assert [json.loads(f.payload) for f in sink.frames] == [{"slots_in_use": 1}]
    assert sink.frames[0].stream == "mvp-node-7-2"
    assert follower.ended is not None and "mvp-node-7-3" in follower.ended
    assert follower.dropped >= 1
    assert "node 2 datastream: dropped a line" in caplog.text
    assert "node 2 datastream: header of mvp-node-7-3" in caplog.text


def test_a_follower_of_a_node_gone_reads_its_connection_out_and_no_other() -> None:
    payload = b"".join(
        [
            encode_message(StreamHeader(7, 2, 1)),
            encode_message(ChannelDecl("mvp.node.kv", 0)),
            encode_message(FrameMsg(0, 0, {"slots_in_use": 0})),
        ]
    )
    hostile = HostileNode(payload)  # says no end, and keeps the connection open
    sink = Collect()
    ds = Datastream(run_id=7, node_id=0, sinks=[sink], summary_interval_s=None)
    follower = NodeFollower(
        ds, run_id=7, node_id=2, endpoint=f"127.0.0.1:{hostile.port}", token=TOKEN
    ).start()
    try:
        wait_until(lambda: len(sink.frames) == 1, timeout=10, what="its frame")
        follower.finish(grace_s=0.2)
        wait_until(lambda: not follower.running, timeout=10, what="the follower to leave")
    finally:
        follower.stop()
        hostile.close()
    assert follower.connections == 1 and follower.ended is None


class FakeEdge:
    def __init__(self, edge_id: int, direction: str) -> None:
        self.edge_id = edge_id
        self.direction = direction
        self.bytes = 0


class FakeStage:
    def __init__(self) -> None:
        self.steps = StepStats(slots_total=4)
        self.links = [FakeEdge(1, "in"), FakeEdge(2, "out")]

    def edges(self) -> list[FakeEdge]:
        return self.links


def test_the_sampler_publishes_what_changed_only() -> None:
    stream = NodeDatastream(7, 2, 1)
    stage = FakeStage()
    current: list[Any] = [None]
    sampler = NodeSampler(stream, lambda: current[0], interval_s=3600)
    sampler.sample()
    assert stream.published == 0  # no stage yet: nothing
    current[0] = stage
    sampler.sample()
    assert stream.positions() == {"mvp.node.kv": 1, "mvp.node.edges": 1}  # first sight
    sampler.sample()
    assert stream.positions() == {"mvp.node.kv": 1, "mvp.node.edges": 1}  # idle: nothing
    stage.steps.record(0.004, True, 1)
    stage.steps.record(0.002, False, 2)
    stage.steps.slots_in_use = 1
    stage.links[0].bytes += 1000
    sampler.sample()
    assert stream.positions() == {"mvp.node.kv": 2, "mvp.node.edges": 2, "mvp.node.steps": 1}
    sampler.sample()  # the bytes stopped moving: said once (0 B/s), then nothing
    sampler.sample()
    assert stream.positions() == {"mvp.node.kv": 2, "mvp.node.edges": 3, "mvp.node.steps": 1}
    sampler.stop()
    frames = _frames(stream)
    steps = frames["mvp.node.steps"][0]
    assert steps["steps"] == 2 and steps["prefill_steps"] == 1 and steps["largest_batch"] == 2
    assert steps["max_ms"] == 4.0 and steps["busy_ms"] == 6.0 and steps["steps_total"] == 2
    assert frames["mvp.node.kv"][-1]["slots_in_use"] == 1
    assert frames["mvp.node.kv"][-1]["slots_total"] == 4
    assert frames["mvp.node.edges"][-1]["in_bytes_per_s"] == 0
    edges = frames["mvp.node.edges"][-2]
    assert edges["in_bytes_per_s"] > 0 and edges["out_bytes_per_s"] == 0
    assert edges["edges"] == [
        {"edge_id": 1, "direction": "in", "bytes": 1000},
        {"edge_id": 2, "direction": "out", "bytes": 0},
    ]


def test_load_progress_is_bounded_in_rate_and_ends_at_the_stage_total() -> None:
    stream = NodeDatastream(7, 2, 1)
    now = [0.0]
    progress = LoadProgress(stream, (15, 30), clock=lambda: now[0])
    sizes = {f"blk.{i}.w": 100 for i in range(15, 30)}
    progress.begin(sizes)
    for name in sizes:  # all within one rate interval: no frame between
        progress.tensor(name)
        progress.tensor(name)  # counted once
    now[0] = 1.0
    progress.tensor("not.the.stages")  # not the stage's: nothing
    progress.done()
    loads = _frames(stream)["mvp.node.load"]
    assert [(r["status"], r["loaded_bytes"]) for r in loads] == [
        ("loading", 0),
        ("loaded", 1500),
    ]
    assert loads[-1]["total_bytes"] == 1500 and loads[-1]["layers"] == [15, 30]
    assert loads[-1]["elapsed_ms"] == 1000


def _frames(stream: NodeDatastream) -> dict[str, list[dict[str, Any]]]:
    """What a follower attaching now gets, by channel (the backlog, decoded)."""
    server = DataPlaneServer(handshake_timeout_s=2.0)
    server.serve_datastream(TOKEN, stream.serve)
    sink = Collect()
    follower = _follower(server, sink)
    try:
        total = sum(stream.positions().values())
        wait_until(lambda: len(sink.frames) == total, timeout=10, what="the backlog")
    finally:
        follower.stop()
        stream.close()
        server.close()
    out: dict[str, list[dict[str, Any]]] = {}
    for f in sink.frames:
        out.setdefault(f.channel, []).append(json.loads(f.payload))
    return out
