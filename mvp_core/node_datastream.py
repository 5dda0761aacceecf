"""A node's own datastream on the wire (DECISIONS 93; process spec 2.8 and 8.10, "worker
datastream connections": stream header, channel declaration, frame, stream end). Pure:
the messages, their encoding, and the follower's checks; the node's publisher is
``workers/node/nodestream.py``, the follower ``mvp_io/datastream/node_follower.py``.

A follower connects to the node's data-plane port and says the data plane's hello
(``mvp_core.edge_auth``) on ``NODE_DATASTREAM_EDGE_ID`` with ``node_datastream_token``;
once answered OK, the node writes JSON lines (UTF-8, each at most ``MAX_LINE_BYTES`` with
its newline) and reads nothing more than the follower's close:

- ``{"type":"header","version":1,"stream","run_id","node_id","stage_index"}``, first;
- ``{"type":"channel","channel","channel_id"}`` before a channel's first frame (every
  channel so far is declared again to a follower that attaches later);
- ``{"type":"frame","channel_id","position","record"}``: ``position`` counts the node's
  frames of that channel from 0 (a follower that attaches later first gets the node's
  last frames again: it drops what it has), ``record`` a JSON object
  (``mvp_core.datastream``'s node records);
- ``{"type":"end","reason"}`` when the node stops; the node then closes.

Everything a node sends is untrusted: ``NodeStreamReader`` checks each line and says
why it drops one (``WireError``); a header for another run or node ends the follow.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mvp_core.datastream import NODE_CHANNEL_PREFIX, encode_record, node_stream_id

WIRE_VERSION = 1
MAX_LINE_BYTES = 32 * 1024  # a line with its newline; a longer one is dropped whole
MAX_CHANNELS = 16  # channels one node may declare
MAX_POSITION = 2**53
MAX_REASON = 200
_CHANNEL = re.compile(re.escape(NODE_CHANNEL_PREFIX) + r"[a-z][a-z0-9_]{0,31}", re.ASCII)


class WireError(ValueError):
    """A line that is dropped, and why; ``fatal``: the follow ends (the stream is not
    the one asked for)."""

    def __init__(self, reason: str, *, fatal: bool = False) -> None:
        super().__init__(reason)
        self.fatal = fatal


@dataclass(frozen=True, slots=True)
class StreamHeader:
    run_id: int
    node_id: int
    stage_index: int
    version: int = WIRE_VERSION

    @property
    def stream(self) -> str:
        return node_stream_id(self.run_id, self.node_id)


@dataclass(frozen=True, slots=True)
class ChannelDecl:
    channel: str
    channel_id: int


@dataclass(frozen=True, slots=True)
class FrameMsg:
    channel_id: int
    position: int
    record: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StreamEnd:
    reason: str


Message = StreamHeader | ChannelDecl | FrameMsg | StreamEnd


def valid_channel(channel: str) -> bool:
    """A node's channel: ``mvp.node.<name>`` (lower case, digits, ``_``; 32 at most)."""
    return bool(_CHANNEL.fullmatch(channel))


def encode_message(msg: Message) -> bytes:
    """One line, with its newline."""
    body: dict[str, Any]
    if isinstance(msg, StreamHeader):
        body = {
            "type": "header",
            "version": msg.version,
            "stream": msg.stream,
            "run_id": msg.run_id,
            "node_id": msg.node_id,
            "stage_index": msg.stage_index,
        }
    elif isinstance(msg, ChannelDecl):
        body = {"type": "channel", "channel": msg.channel, "channel_id": msg.channel_id}
    elif isinstance(msg, FrameMsg):
        body = {
            "type": "frame",
            "channel_id": msg.channel_id,
            "position": msg.position,
            "record": msg.record,
        }
    else:
        body = {"type": "end", "reason": msg.reason[:MAX_REASON]}
    return encode_record(body) + b"\n"


def _shown(value: Any, limit: int = 40) -> str:
    """A node's value as a log line may quote it: its repr, cut to ``limit``."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _int(body: Mapping[str, Any], key: str, upper: int) -> int:
    value = body.get(key)
    if type(value) is not int or not 0 <= value < upper:
        raise WireError(f"{key} {_shown(value)} is not an integer in 0..{upper - 1}")
    return value


def decode_message(line: bytes) -> Message:
    """The message a line holds (its newline optional); ``WireError`` says why not."""
    if len(line) > MAX_LINE_BYTES:
        raise WireError(f"line of {len(line)} bytes (at most {MAX_LINE_BYTES})")
    try:
        body = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise WireError("not a JSON line") from None
    if not isinstance(body, dict):
        raise WireError("not a JSON object")
    kind = body.get("type")
    if kind == "header":
        version = _int(body, "version", 1 << 16)
        if version != WIRE_VERSION:
            raise WireError(f"wire version {version} (this follower reads {WIRE_VERSION})")
        header = StreamHeader(
            _int(body, "run_id", 1 << 63),
            _int(body, "node_id", 1 << 63),
            _int(body, "stage_index", 1 << 31),
        )
        if body.get("stream") != header.stream:
            raise WireError(f"stream {_shown(body.get('stream'))} is not {header.stream!r}")
        return header
    if kind == "channel":
        channel = body.get("channel")
        if not isinstance(channel, str) or not valid_channel(channel):
            raise WireError(f"channel {_shown(channel)} is not a node's (mvp.node.<name>)")
        return ChannelDecl(channel, _int(body, "channel_id", MAX_CHANNELS))
    if kind == "frame":
        record = body.get("record")
        if not isinstance(record, dict):
            raise WireError("a frame's record is not a JSON object")
        return FrameMsg(
            _int(body, "channel_id", MAX_CHANNELS), _int(body, "position", MAX_POSITION), record
        )
    if kind == "end":
        reason = body.get("reason")
        return StreamEnd(str(reason)[:MAX_REASON] if reason is not None else "")
    raise WireError(f"unknown message type {_shown(kind)}")


@dataclass(frozen=True, slots=True)
class Accepted:
    """A frame to pass on: its channel, the node's position, the record's bytes."""

    channel: str
    position: int
    payload: bytes


class NodeStreamReader:
    """The follower's side of one node's stream, across its connections: checks each
    line in order and gives back the frames to pass on.

    ``accept`` returns an ``Accepted`` frame, a ``StreamEnd``, or None (a header or
    channel taken; a frame the follower already passed on, which a reconnection's
    replay brings again). It raises ``WireError`` for a line it drops: malformed, a
    frame before the header or of a channel not declared, a channel re-declared with
    another id, too many channels; fatal for a header of another run or node.
    ``last`` is each channel's last position passed on (kept across connections:
    ``reconnected`` starts a new one)."""

    def __init__(self, run_id: int, node_id: int, last: Mapping[str, int] | None = None) -> None:
        self.run_id = int(run_id)
        self.node_id = int(node_id)
        self.stream = node_stream_id(self.run_id, self.node_id)
        self.last: dict[str, int] = dict(last or {})
        self.header: StreamHeader | None = None
        self._ids: dict[int, str] = {}

    def reconnected(self) -> None:
        """A new connection: its header and channels come again."""
        self.header = None
        self._ids = {}

    def accept(self, line: bytes) -> Accepted | StreamEnd | None:
        msg = decode_message(line)
        if isinstance(msg, StreamHeader):
            if (msg.run_id, msg.node_id) != (self.run_id, self.node_id):
                raise WireError(
                    f"header of {msg.stream}, not of {self.stream}: not followed", fatal=True
                )
            self.header = msg
            return None
        if self.header is None:
            raise WireError(f"a {type(msg).__name__} before the stream header")
        if isinstance(msg, ChannelDecl):
            known = self._ids.get(msg.channel_id)
            if known is not None and known != msg.channel:
                raise WireError(f"channel id {msg.channel_id} re-declared as {msg.channel}")
            if known is None and msg.channel in self._ids.values():
                raise WireError(f"channel {msg.channel} declared twice")
            if known is None and len(self._ids) >= MAX_CHANNELS:
                raise WireError(f"more than {MAX_CHANNELS} channels")
            self._ids[msg.channel_id] = msg.channel
            return None
        if isinstance(msg, StreamEnd):
            return msg
        channel = self._ids.get(msg.channel_id)
        if channel is None:
            raise WireError(f"a frame of channel id {msg.channel_id}, never declared")
        if msg.position <= self.last.get(channel, -1):
            return None  # passed on already (a reconnection's replay)
        self.last[channel] = msg.position
        return Accepted(channel, msg.position, encode_record(msg.record))
