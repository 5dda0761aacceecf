"""The head node's text stream: each prompt's text deltas straight to the clients that
read them, beside Temporal (DECISIONS 63).

The generate activity puts every delta here as it forms; a client on a host with the
deployment's edge secret connects to the node's data-plane port with the text-stream
token (mvp_core.edge_auth), names a prompt by its workflow id, and reads the prompt's
deltas as JSON lines (``TextDelta``) from the first one, then ``{"type": "end"}`` once
the node has made its last text. The prompt's one terminal event still comes from
Temporal (the Update's or the prompt workflow's result): this stream only carries text,
so a client that loses it falls back to the prompt workflow's stream and the result.

While a client reads a prompt here, the node publishes nothing of its text to Temporal
(the run's history stays a few events per prompt whatever its length); when the last
reader leaves, the node publishes the text it owes at once and then as before.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field

from mvp_core.models import TextDelta

log = logging.getLogger("mvp.textstream")

END_LINE = b'{"type":"end"}\n'
MAX_REQUEST = 4096  # bytes of a client's one request line
REQUEST_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 30.0  # a client that takes no text this long is dropped
LINGER_S = 60.0  # an ended prompt's text stays readable this long


class TextRequestError(ValueError):
    """A client's request line is not one this stream serves; the message says why."""


@dataclass
class _Text:
    lines: list[bytes] = field(default_factory=list)  # one JSON line per delta
    ended_at: float | None = None


class TextHub:
    """Every prompt this node generates (by prompt workflow id): its deltas so far, and
    how many clients read it."""

    def __init__(self, linger_s: float = LINGER_S) -> None:
        self.linger_s = linger_s
        self._cond = threading.Condition()
        self._texts: dict[str, _Text] = {}
        self._readers: dict[str, int] = {}
        self._closed = False

    # ------------------------------------------------------------------ the generate side
    def open(self, key: str) -> None:
        with self._cond:
            self._prune()
            self._texts[key] = _Text()
            self._cond.notify_all()

    def put(self, key: str, delta: TextDelta) -> None:
        line = delta.model_dump_json(exclude_none=True).encode() + b"\n"
        with self._cond:
            text = self._texts.get(key)
            if text is not None and text.ended_at is None:
                text.lines.append(line)
                self._cond.notify_all()

    def end(self, key: str) -> None:
        with self._cond:
            text = self._texts.get(key)
            if text is not None and text.ended_at is None:
                text.ended_at = time.monotonic()
                self._cond.notify_all()

    def readers(self, key: str) -> int:
        with self._cond:
            return self._readers.get(key, 0)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _prune(self) -> None:
        now = time.monotonic()
        for key in [
            k
            for k, t in self._texts.items()
            if t.ended_at is not None and now - t.ended_at > self.linger_s
        ]:
            del self._texts[key]

    # ------------------------------------------------------------------ the client side
    def serve(self, sock: socket.socket, peer: str) -> None:
        """One authenticated client (DataPlaneServer.serve_text): its request line, then
        the prompt's deltas from the one it asks for, then the end line."""
        try:
            key, start = _read_request(sock)
        except TextRequestError as err:
            log.warning("text stream: bad request from %s: %s", peer, err)
            _send(sock, json.dumps({"type": "error", "error": str(err)}).encode() + b"\n")
            return
        with self._cond:
            self._readers[key] = self._readers.get(key, 0) + 1
        try:
            self._stream(sock, key, start)
        finally:
            with self._cond:
                left = self._readers[key] - 1
                if left:
                    self._readers[key] = left
                else:
                    del self._readers[key]

    def _stream(self, sock: socket.socket, key: str, pos: int) -> None:
        while True:
            with self._cond:

                def ready(at: int = pos) -> bool:
                    return self._closed or self._news(key, at)

                self._cond.wait_for(ready, timeout=1.0)
                if self._closed:
                    return
                text = self._texts.get(key)
                lines = text.lines[pos:] if text is not None else []
                ended = text is not None and text.ended_at is not None
            if lines:
                _send(sock, b"".join(lines))
                pos += len(lines)
            elif ended:
                _send(sock, END_LINE)
                return
            elif _peer_gone(sock):
                return

    def _news(self, key: str, pos: int) -> bool:
        text = self._texts.get(key)
        return text is not None and (len(text.lines) > pos or text.ended_at is not None)


def _read_request(sock: socket.socket) -> tuple[str, int]:
    """``{"prompt_workflow_id": str, "from": int}``: which prompt, from which delta."""
    sock.settimeout(REQUEST_TIMEOUT_S)
    data = b""
    while b"\n" not in data:
        try:
            chunk = sock.recv(MAX_REQUEST + 1 - len(data))
        except TimeoutError:
            raise TextRequestError("no request line within 10 s") from None
        if not chunk:
            raise TextRequestError("closed before its request line")
        data += chunk
        if len(data) > MAX_REQUEST:
            raise TextRequestError(f"request line longer than {MAX_REQUEST} bytes")
    try:
        req = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        raise TextRequestError("request line is not JSON") from None
    if not isinstance(req, dict):
        raise TextRequestError("request line is not a JSON object")
    key, start = req.get("prompt_workflow_id"), req.get("from", 0)
    if not isinstance(key, str) or not key or len(key) > 1000:
        raise TextRequestError("prompt_workflow_id must be a non-empty string")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise TextRequestError("from must be a non-negative integer")
    sock.settimeout(SEND_TIMEOUT_S)
    return key, start


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(data)


def _peer_gone(sock: socket.socket) -> bool:
    """The client closed its end (it sends nothing after its request)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True
