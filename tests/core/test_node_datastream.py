"""A node's own datastream on the wire (DECISIONS 93): its messages (header, channel,
frame, end), the node records' shapes, and the follower's checks of what an untrusted
node sends."""

from __future__ import annotations

import json

import pytest

from mvp_core import datastream as ds
from mvp_core.edge_auth import NODE_DATASTREAM_EDGE_ID, TEXT_STREAM_EDGE_ID, node_datastream_token
from mvp_core.node_datastream import (
    MAX_CHANNELS,
    MAX_LINE_BYTES,
    Accepted,
    ChannelDecl,
    FrameMsg,
    NodeStreamReader,
    StreamEnd,
    StreamHeader,
    WireError,
    decode_message,
    encode_message,
    valid_channel,
)

pytestmark = pytest.mark.quick


def test_messages_round_trip_as_json_lines() -> None:
    header = StreamHeader(run_id=7, node_id=2, stage_index=1)
    line = encode_message(header)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {
        "type": "header",
        "version": 1,
        "stream": "mvp-node-7-2",
        "run_id": 7,
        "node_id": 2,
        "stage_index": 1,
    }
    for msg in (
        header,
        ChannelDecl("mvp.node.load", 0),
        FrameMsg(0, 3, {"type": "NodeLoad", "loaded_bytes": 10}),
        StreamEnd("stopped"),
    ):
        assert decode_message(encode_message(msg)) == msg


def test_the_node_records_have_their_documented_shapes() -> None:
    load = ds.node_load_record(7, 2, 1, (15, 30), 100, 200, "loading", 12)
    assert load == {
        "type": "NodeLoad",
        "run_id": 7,
        "node_id": 2,
        "stage_index": 1,
        "layers": [15, 30],
        "loaded_bytes": 100,
        "total_bytes": 200,
        "status": "loading",
        "elapsed_ms": 12,
    }
    with pytest.raises(ValueError):
        ds.node_load_record(7, 2, 1, (0, 1), 0, 0, "half", 0)
    steps = ds.node_steps_record(
        7,
        2,
        1,
        interval_ms=500,
        steps=4,
        prefill_steps=1,
        busy_ms=10.0,
        max_ms=4.0,
        largest_batch=2,
        steps_total=9,
    )
    assert steps["type"] == "NodeSteps" and steps["mean_ms"] == 2.5
    assert ds.node_steps_record(7, 2, 1, interval_ms=1, steps=0, prefill_steps=0, busy_ms=0,
                                max_ms=0, largest_batch=0, steps_total=0)["mean_ms"] == 0.0  # fmt: skip
    edges = ds.node_edges_record(
        7, 2, 1, interval_ms=500, in_bytes_per_s=1.26, out_bytes_per_s=2, edges=[(3, "in", 40)]
    )
    assert edges["edges"] == [{"edge_id": 3, "direction": "in", "bytes": 40}]
    assert (edges["in_bytes_per_s"], edges["out_bytes_per_s"]) == (1.3, 2.0)  # 0.1 B/s
    kv = ds.node_kv_record(7, 2, 1, 1, 8)
    assert kv == {
        "type": "NodeKv",
        "run_id": 7,
        "node_id": 2,
        "stage_index": 1,
        "slots_in_use": 1,
        "slots_total": 8,
    }
    assert all(valid_channel(c) for c in ds.NODE_CHANNELS)


def test_the_node_datastream_token_is_its_own_and_the_edge_id_reserved() -> None:
    token = node_datastream_token("a" * 32)
    assert len(token) == 32 and token != "a" * 32
    assert token == node_datastream_token("a" * 32) != node_datastream_token("b" * 32)
    assert NODE_DATASTREAM_EDGE_ID not in (TEXT_STREAM_EDGE_ID, 0)


def _lines(*msgs: object) -> list[bytes]:
    return [encode_message(m) for m in msgs]  # type: ignore[arg-type]


def test_the_reader_passes_on_declared_frames_in_order_once() -> None:
    r = NodeStreamReader(7, 2)
    got = [
        r.accept(line)
        for line in _lines(
            StreamHeader(7, 2, 1),
            ChannelDecl("mvp.node.kv", 0),
            FrameMsg(0, 0, {"slots_in_use": 1}),
            FrameMsg(0, 2, {"slots_in_use": 0}),  # a gap: the node dropped one for us
        )
    ]
    assert got[:2] == [None, None]
    assert got[2] == Accepted("mvp.node.kv", 0, b'{"slots_in_use":1}')
    assert isinstance(got[3], Accepted) and got[3].position == 2
    # A new connection replays the node's backlog: what was passed on is not again.
    r.reconnected()
    replay = [
        r.accept(line)
        for line in _lines(
            StreamHeader(7, 2, 1),
            ChannelDecl("mvp.node.kv", 0),
            FrameMsg(0, 0, {"slots_in_use": 1}),
            FrameMsg(0, 2, {"slots_in_use": 0}),
            FrameMsg(0, 3, {"slots_in_use": 2}),
            StreamEnd("stopped"),
        )
    ]
    assert replay[:4] == [None, None, None, None]
    assert isinstance(replay[4], Accepted) and replay[4].position == 3
    assert replay[5] == StreamEnd("stopped")
    assert r.last == {"mvp.node.kv": 3}
    # A later follower resumes from what an earlier one passed on.
    later = NodeStreamReader(7, 2, last=r.last)
    later.accept(encode_message(StreamHeader(7, 2, 1)))
    later.accept(encode_message(ChannelDecl("mvp.node.kv", 5)))
    assert later.accept(encode_message(FrameMsg(5, 3, {}))) is None
    assert later.accept(encode_message(FrameMsg(5, 4, {}))) == Accepted("mvp.node.kv", 4, b"{}")


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b"not json\n", "not a JSON line"),
        (b"[1, 2]\n", "not a JSON object"),
        (b'{"type": "shout"}\n', "unknown message type"),
        (
            b'{"type": "channel", "channel": "mvp.orch.lifecycle", "channel_id": 1}\n',
            "not a node's",
        ),
        (b'{"type": "channel", "channel": "mvp.node.x", "channel_id": 99}\n', "channel_id 99"),
        (b'{"type": "frame", "channel_id": 0, "position": -1, "record": {}}\n', "position -1"),
        (b'{"type": "frame", "channel_id": 0, "position": true, "record": {}}\n', "position True"),
        (b'{"type": "frame", "channel_id": 0, "position": 1, "record": "text"}\n', "not a JSON"),
        (b'{"type": "frame", "channel_id": 3, "position": 1, "record": {}}\n', "never declared"),
        (b'{"type": "channel", "channel": "mvp.node.kv", "channel_id": 1}\n', "declared twice"),
        (b'{"type": "channel", "channel": "mvp.node.other", "channel_id": 0}\n', "re-declared"),
        (b"[" * 100_000 + b"\n", "line of"),
        (b"[" * 5_000 + b"]" * 5_000 + b"\n", "not a JSON"),  # nesting too deep
    ],
)
def test_the_reader_drops_what_a_node_should_not_send(line: bytes, says: str) -> None:
    r = NodeStreamReader(7, 2)
    r.accept(encode_message(StreamHeader(7, 2, 1)))
    r.accept(encode_message(ChannelDecl("mvp.node.kv", 0)))
    with pytest.raises(WireError) as err:
        r.accept(line)
    assert says in str(err.value) and not err.value.fatal, err.value
    # ... and goes on: the next good frame is passed on.
    assert r.accept(encode_message(FrameMsg(0, 0, {}))) == Accepted("mvp.node.kv", 0, b"{}")


def test_a_header_of_another_node_ends_the_follow_and_frames_need_a_header() -> None:
    r = NodeStreamReader(7, 2)
    with pytest.raises(WireError, match="before the stream header"):
        r.accept(encode_message(FrameMsg(0, 0, {})))
    with pytest.raises(WireError) as err:
        r.accept(encode_message(StreamHeader(7, 3, 1)))
    assert err.value.fatal and "mvp-node-7-3" in str(err.value)
    forged = b'{"type":"header","version":1,"stream":"mvp-orchestrator-7","run_id":7,'
    forged += b'"node_id":2,"stage_index":0}\n'
    with pytest.raises(WireError, match="is not 'mvp-node-7-2'"):
        r.accept(forged)
    with pytest.raises(WireError, match="wire version 2"):
        r.accept(b'{"type":"header","version":2}\n')


def test_a_node_declares_at_most_its_share_of_channels() -> None:
    r = NodeStreamReader(7, 2)
    r.accept(encode_message(StreamHeader(7, 2, 1)))
    for i in range(MAX_CHANNELS):
        r.accept(encode_message(ChannelDecl(f"mvp.node.c{i}", i)))
    with pytest.raises(WireError):
        r.accept(encode_message(ChannelDecl("mvp.node.more", MAX_CHANNELS)))
    assert len(encode_message(FrameMsg(0, 0, {"x": "y" * 100}))) < MAX_LINE_BYTES


def test_what_a_node_sent_is_quoted_short_in_a_drop_reason() -> None:
    r = NodeStreamReader(7, 2)
    long = "x" * 20_000
    header = json.dumps(
        {
            "type": "header",
            "version": 1,
            "stream": long,
            "run_id": 7,
            "node_id": 2,
            "stage_index": 0,
        }
    )
    for line in (
        header.encode(),
        json.dumps({"type": long}).encode(),
        json.dumps({"type": "channel", "channel": long, "channel_id": 0}).encode(),
        json.dumps(
            {"type": "frame", "channel_id": [0] * 5_000, "position": 0, "record": {}}
        ).encode(),
    ):
        with pytest.raises(WireError) as err:
            r.accept(line)
        assert len(str(err.value)) < 200, str(err.value)[:300]
