"""Fixtures of the node's tests: a head node's text stream on a real loopback socket."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from mvp_core.edge_auth import ANSWER, ANSWER_OK, TEXT_STREAM_EDGE_ID, hello, text_stream_token
from workers.node.dataplane import DataPlaneServer
from workers.node.textpath import TextHub

TOKEN = text_stream_token(b"s" * 32, "mvp-run-7", "0123456789abcdef")


@pytest.fixture
def text_node() -> Iterator[tuple[DataPlaneServer, TextHub]]:
    """A data-plane server serving a text hub's stream to readers with TOKEN."""
    server = DataPlaneServer()
    hub = TextHub()
    server.serve_text(TOKEN, hub.serve)
    yield server, hub
    hub.close()
    server.close()


def answer_to(server: DataPlaneServer, token: str, line: bytes) -> bytes:
    """What the text stream answers ``line`` with, after a handshake with ``token``."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(hello(TEXT_STREAM_EDGE_ID, token))
        status, size = ANSWER.unpack(sock.recv(ANSWER.size, socket.MSG_WAITALL))
        assert status == ANSWER_OK and size == 0
        sock.sendall(line)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    return answer
