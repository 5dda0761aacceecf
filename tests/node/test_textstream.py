"""The head node's text stream (DECISIONS 63): the node half (workers/node/textpath.py
behind DataPlaneServer.serve_text) and the client half (temporal/text_stream.py) over a
real loopback socket: a prompt's deltas in order from any point, its end, readers that
come before the prompt starts, and refusals that name what was wrong."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest

from mvp_core.edge_auth import ANSWER, ANSWER_OK, TEXT_STREAM_EDGE_ID, hello
from mvp_core.models import Done, TextDelta, TokenLogprob
from temporal.text_stream import (
    TextStreamError,
    TextStreamRefused,
    TextStreamTarget,
    TextStreamUnreachable,
    probe,
    read_text,
)
from tests.helpers.waits import eventually
from tests.node.conftest import TOKEN, answer_to
from workers.node import textpath
from workers.node.dataplane import DataPlaneServer
from workers.node.textpath import TextFanout, TextHub, end_line

KEY = "mvp-prompt-7-1-abc"


def _delta(i: int) -> TextDelta:
    return TextDelta(request_id=1, text=f"piece{i} ", tokens=1, prompt_tokens=5 if i == 0 else None)


async def _read(target: TextStreamTarget, key: str = KEY, start: int = 0) -> list[TextDelta]:
    return [d async for d in read_text(target, key, start)]


async def test_a_reader_gets_every_delta_in_order_then_the_end(text_node):
    server, hub = text_node
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


async def test_a_wrong_token_is_refused_by_name(text_node):
    server, hub = text_node
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
        # A reader with the run's token may send its prompt (an early start): 4 MiB.
        (b"x" * (textpath.MAX_START_REQUEST + 1), f"longer than {4 << 20} bytes"),
    ],
)
def test_a_bad_request_line_is_answered_with_what_is_wrong(text_node, line, error):
    server, hub = text_node
    answer = answer_to(server, TOKEN, line)
    assert b'"type": "error"' in answer and error.encode() in answer
    assert hub.readers("k") == 0


async def test_a_reader_that_leaves_is_no_longer_counted(text_node):
    server, hub = text_node
    hub.open(KEY)
    hub.put(KEY, _delta(0))
    target = TextStreamTarget(server.host, server.port, TOKEN)
    deltas = read_text(target, KEY)
    assert await anext(deltas) == _delta(0)
    assert hub.readers(KEY) == 1
    await deltas.aclose()
    # The node notices within its 1 s idle check.
    await eventually(lambda: hub.readers(KEY) == 0, timeout=10, what="the reader no longer counted")


async def test_a_probe_knocks_without_a_secret_and_the_node_stays_quiet(text_node, caplog):
    """DECISIONS 94: the gateway's knock at start shows the public reader token, gets the
    node's answer and leaves; the node counts no reader and warns of nothing. A port
    nobody listens on is TextStreamUnreachable, naming the address."""
    server, hub = text_node
    with caplog.at_level("DEBUG"):
        await probe(TextStreamTarget(server.host, server.port, TOKEN))
        await probe(TextStreamTarget(server.host, server.port, None))

        def taken() -> int:  # the node's thread has let each knock go (quietly)
            return sum("closed before its request line" in r.getMessage() for r in caplog.records)

        await eventually(lambda: taken() == 2, timeout=10, what="the node to let both go")
        assert hub.readers(KEY) == 0
    assert not [r for r in caplog.records if r.levelno > logging.DEBUG], caplog.records
    port = _closed_port()
    with pytest.raises(TextStreamUnreachable, match=f"cannot connect to 127.0.0.1:{port}: "):
        await probe(TextStreamTarget("127.0.0.1", port, TOKEN))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ keyed readers (DECISIONS 80)

READER_KEY = "0123456789abcdef0123456789abcdef"


def _keyed(server: DataPlaneServer) -> TextStreamTarget:
    """A reader on a host without the deployment's secret: no token, the prompt's key."""
    return TextStreamTarget(server.host, server.port, None)


async def test_a_keyed_reader_waits_for_its_prompt_then_reads_it_with_its_key(text_node):
    server, hub = text_node
    reading = asyncio.ensure_future(_keyed_read(_keyed(server), READER_KEY))
    await asyncio.sleep(0.3)
    assert hub.readers(KEY) == 0  # not a reader before its key was checked
    hub.open(KEY, READER_KEY)
    await eventually(lambda: hub.readers(KEY) == 1, timeout=10, what="the keyed reader admitted")
    for i in range(3):
        hub.put(KEY, _delta(i))
    hub.end(KEY)
    assert await asyncio.wait_for(reading, 10) == [_delta(i) for i in range(3)]
    # A reader with the secret's token reads the same prompt without its key.
    assert await _read(TextStreamTarget(server.host, server.port, TOKEN)) == [
        _delta(i) for i in range(3)
    ]


async def _keyed_read(target: TextStreamTarget, key: str, prompt: str = KEY) -> list[TextDelta]:
    return [d async for d in read_text(target, prompt, key=key)]


async def test_a_wrong_or_missing_key_reads_nothing_and_counts_as_no_reader(text_node):
    server, hub = text_node
    hub.open(KEY, READER_KEY)
    hub.put(KEY, _delta(0))
    with pytest.raises(TextStreamError, match="wrong key for prompt"):
        await _keyed_read(_keyed(server), "f" * 32)
    hub.open("mvp-prompt-7-2-k")  # admitted without a key: no keyed reader at all
    with pytest.raises(TextStreamError, match="wrong key for prompt"):
        await _keyed_read(_keyed(server), READER_KEY, "mvp-prompt-7-2-k")
    with pytest.raises(TextStreamError, match="no text-stream token here and no key"):
        await _read(_keyed(server))
    assert hub.readers(KEY) == 0 and hub.readers("mvp-prompt-7-2-k") == 0


@pytest.mark.parametrize("shown", [None, 7, "ABCDEF0123456789ABCDEF0123456789", "0" * 31, "0" * 33])
def test_a_keyed_request_without_a_well_formed_key_is_refused_by_name(text_node, shown):
    from mvp_core.edge_auth import TEXT_READER_TOKEN

    server, hub = text_node
    hub.open("k", READER_KEY)
    request: dict[str, object] = {"prompt_workflow_id": "k", "from": 0}
    if shown is not None:
        request["key"] = shown
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(hello(TEXT_STREAM_EDGE_ID, TEXT_READER_TOKEN))
        status, _ = ANSWER.unpack(sock.recv(ANSWER.size, socket.MSG_WAITALL))
        assert status == ANSWER_OK
        sock.sendall(json.dumps(request).encode() + b"\n")
        answer = sock.makefile("rb").readline()
    assert b"key must be the prompt's key: 32 lowercase hex digits" in answer
    assert hub.readers("k") == 0


async def test_a_keyed_reader_whose_prompt_does_not_come_is_told_to_ask_again(
    text_node, monkeypatch
):
    from temporal.text_stream import TextNotYet
    from workers.node import textpath

    server, _hub = text_node
    monkeypatch.setattr(textpath, "KEYED_WAIT_S", 0.5)
    with pytest.raises(TextNotYet, match="not on this node yet"):
        await _keyed_read(_keyed(server), READER_KEY)


@pytest.mark.parametrize("bound", ["MAX_KEYED_READERS", "MAX_KEYED_PER_PEER"])
async def test_keyed_readers_at_once_are_bounded(text_node, monkeypatch, bound):
    """In all, and from one address (the hello token is public: one peer may not hold
    every place); past the bound a reader is told the node is busy, to ask again."""
    from temporal.text_stream import TextNotYet
    from workers.node.dataplane import textserve

    server, hub = text_node
    monkeypatch.setattr(textserve, bound, 1)
    waiting = asyncio.ensure_future(_keyed_read(_keyed(server), READER_KEY))
    await eventually(lambda: sum(server._text._keyed.values()) == 1, timeout=10, what="held")
    with pytest.raises(TextNotYet, match="too many keyed readers"):
        await _keyed_read(_keyed(server), READER_KEY)
    hub.open(KEY, READER_KEY)
    hub.end(KEY)
    assert await asyncio.wait_for(waiting, 10) == []
    # Its place is free again once the node's thread let go of it (it may do so a moment
    # after the reader has the end line: a client told "busy" asks again).
    await eventually(lambda: not server._text._keyed, timeout=10, what="the place freed")
    assert await _keyed_read(_keyed(server), READER_KEY) == []


def test_deltas_owed_to_temporal_keep_their_logprobs_in_order() -> None:
    """What a direct reader took goes to Temporal in one delta when it leaves: the text,
    the token count and the logprobs of every delta it holds, in order (none: None)."""

    class Topic:
        def __init__(self) -> None:
            self.got: list[TextDelta] = []

        def publish(self, item: TextDelta, *, force_flush: bool = False) -> None:
            self.got.append(item)

    def lp(token: str) -> TokenLogprob:
        return TokenLogprob(token=token, logprob=-1.0, bytes=list(token.encode()))

    hub, topic = TextHub(), Topic()
    out = TextFanout(hub, "p", topic)
    hub._readers["p"] = 1  # a direct reader: the deltas are owed to Temporal
    out.put(TextDelta(request_id=1, text="a", tokens=1, logprobs=[lp("a")]))
    out.put(TextDelta(request_id=1, text="bc", tokens=2, logprobs=[lp("b"), lp("c")]))
    out.end(done=False)
    assert [(d.text, d.tokens, [e.token for e in d.logprobs or ()]) for d in topic.got] == [
        ("abc", 3, ["a", "b", "c"])
    ]
    plain = TextFanout(hub, "q", topic)
    hub._readers["q"] = 1
    plain.put(TextDelta(request_id=2, text="x", tokens=1))
    plain.end(done=False)
    assert topic.got[-1].logprobs is None


def _done(text: str = "piece0 piece1 ") -> Done:
    return Done(
        request_id=1,
        final_text=text,
        tokens_generated=2,
        elapsed_ms=40,
        stop_reason="max_tokens",
        prompt_tokens=5,
    )


async def test_an_end_with_the_prompts_done_hands_it_to_the_reader(text_node, monkeypatch):
    """DECISIONS 95: the end line of a prompt the node generated to its end carries its
    Done, which the reader gets with the end; a plain end, a Done too long for an end
    line, or an end line whose Done does not read as one hand it nothing."""
    server, hub = text_node
    target = TextStreamTarget(server.host, server.port, TOKEN)

    async def read_end(key: str) -> tuple[list[TextDelta], list[Done]]:
        told: list[Done] = []
        deltas = [d async for d in read_text(target, key, on_terminal=told.append)]
        return deltas, told

    hub.open(KEY)
    hub.put(KEY, _delta(0))
    hub.put(KEY, _delta(1))
    hub.end(KEY, _done())
    assert await read_end(KEY) == ([_delta(0), _delta(1)], [_done()])
    hub.open("plain")
    hub.put("plain", _delta(0))
    hub.end("plain")
    assert await read_end("plain") == ([_delta(0)], [])
    assert end_line(_done("x" * 300)).startswith(b'{"type":"end","terminal":{')
    monkeypatch.setattr(textpath, "MAX_TERMINAL_LINE", 300)
    hub.open("long")
    hub.end("long", _done("x" * 300))
    assert await read_end("long") == ([], [])


async def test_an_end_line_whose_done_is_not_one_is_a_plain_end(text_node):
    server, hub = text_node
    hub.open(KEY)
    hub.put(KEY, _delta(0))
    hub.end(KEY)
    with hub._cond:  # a node that sends a malformed Done
        hub._texts[KEY].end_line = b'{"type":"end","terminal":{"type":"done","final_text":7}}\n'
    told: list[Done] = []
    target = TextStreamTarget(server.host, server.port, TOKEN)
    got = [d async for d in read_text(target, KEY, on_terminal=told.append)]
    assert got == [_delta(0)] and told == []
