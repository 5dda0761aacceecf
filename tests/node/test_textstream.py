"""The head node's text stream (DECISIONS 63): the node half (workers/node/textpath.py
behind DataPlaneServer.serve_text) and the client half (temporal/text_stream.py) over a
real loopback socket: a prompt's deltas in order from any point, its end, readers that
come before the prompt starts, and refusals that name what was wrong."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from mvp_core.edge_auth import ANSWER, ANSWER_OK, TEXT_STREAM_EDGE_ID, hello, text_stream_token
from mvp_core.models import TextDelta
from temporal.text_stream import TextStreamError, TextStreamRefused, TextStreamTarget, read_text
from tests.helpers.waits import eventually
from workers.node.dataplane import DataPlaneServer
from workers.node.textpath import TextHub

TOKEN = text_stream_token(b"s" * 32, "mvp-run-7", "0123456789abcdef")
KEY = "mvp-prompt-7-1-abc"


@pytest.fixture
def node() -> Iterator[tuple[DataPlaneServer, TextHub]]:
    server = DataPlaneServer()
    hub = TextHub()
    server.serve_text(TOKEN, hub.serve)
    yield server, hub
    hub.close()
    server.close()


def _delta(i: int) -> TextDelta:
    return TextDelta(request_id=1, text=f"piece{i} ", tokens=1, prompt_tokens=5 if i == 0 else None)


async def _read(target: TextStreamTarget, key: str = KEY, start: int = 0) -> list[TextDelta]:
    return [d async for d in read_text(target, key, start)]


async def test_a_reader_gets_every_delta_in_order_then_the_end(node):
    server, hub = node
    target = TextStreamTarget(server.host, server.port, TOKEN)
    reading = asyncio.ensure_future(_read(target))  # before the prompt starts
    await eventually(lambda: hub.readers(KEY), timeout=10, what="the node to count a reader")
    assert hub.readers(KEY) == 1  # the node knows a client reads it
    hub.open(KEY)
    for i in range(5):
        hub.put(KEY, _delta(i))
        await asyncio.sleep(0.01)
    hub.end(KEY)
    got = await asyncio.wait_for(reading, 10)
    assert got == [_delta(i) for i in range(5)]
    # The server's thread lets go of the reader after the client's end.
    await eventually(lambda: hub.readers(KEY) == 0, timeout=10, what="the reader let go")
    # An ended prompt stays readable for a while, from any delta on.
    assert await _read(target, start=3) == [_delta(3), _delta(4)]
    hub.put(KEY, _delta(9))  # nothing is added after the end
    assert await _read(target) == [_delta(i) for i in range(5)]


async def test_a_wrong_token_is_refused_by_name(node):
    server, hub = node
    hub.open(KEY)
    with pytest.raises(TextStreamRefused, match="wrong text-stream token"):
        await _read(TextStreamTarget(server.host, server.port, "x" * 32))
    other = DataPlaneServer()  # a node without a text stream
    try:
        with pytest.raises(TextStreamRefused, match="serves no text stream"):
            await _read(TextStreamTarget(other.host, other.port, TOKEN))
    finally:
        other.close()
    with pytest.raises(TextStreamError, match="cannot connect"):
        await _read(TextStreamTarget("127.0.0.1", _closed_port(), TOKEN))


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"not json\n", "request line is not JSON"),
        (b"[1]\n", "not a JSON object"),
        (b'{"from": 0}\n', "prompt_workflow_id must be a non-empty string"),
        (b'{"prompt_workflow_id": "k", "from": -1}\n', "from must be a non-negative integer"),
        (b"x" * 5000, "longer than 4096 bytes"),
    ],
)
def test_a_bad_request_line_is_answered_with_what_is_wrong(node, line, error):
    server, hub = node
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(hello(TEXT_STREAM_EDGE_ID, TOKEN))
        status, size = ANSWER.unpack(sock.recv(ANSWER.size, socket.MSG_WAITALL))
        assert status == ANSWER_OK and size == 0
        sock.sendall(line)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert b'"type": "error"' in answer and error.encode() in answer
    assert hub.readers("k") == 0


async def test_a_reader_that_leaves_is_no_longer_counted(node):
    server, hub = node
    hub.open(KEY)
    hub.put(KEY, _delta(0))
    target = TextStreamTarget(server.host, server.port, TOKEN)
    deltas = read_text(target, KEY)
    assert await anext(deltas) == _delta(0)
    assert hub.readers(KEY) == 1
    await deltas.aclose()
    # The node notices within its 1 s idle check.
    await eventually(lambda: hub.readers(KEY) == 0, timeout=10, what="the reader no longer counted")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
