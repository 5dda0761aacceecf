"""The head node's text stream on the data-plane port: a connection whose hello names the
reserved edge id (mvp_core.edge_auth.TEXT_STREAM_EDGE_ID) with the text-stream token is
handed to the node's handler (workers/node/textpath.py) instead of becoming an edge; one
whose hello carries TEXT_READER_TOKEN is handed over as a keyed reader (DECISIONS 80),
whose prompt key the handler checks, at most MAX_KEYED_READERS at once."""

from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Callable

from mvp_core.edge_auth import ANSWER_REJECT, ANSWER_RETRY, TEXT_READER_TOKEN

from .endpoint import log
from .handshake import answer, answer_ok

__all__ = ["TextHandler", "TextStreamGate"]

# handler(sock, peer, keyed): keyed, the reader showed no text-stream token, and must show
# its prompt's key in its request.
TextHandler = Callable[[socket.socket, str, bool], None]
MAX_KEYED_READERS = 256  # keyed readers served at once (each holds a thread)
MAX_KEYED_PER_PEER = 32  # ... from one address (the hello token is public: one peer
# holding every slot would starve the rest)
_READER = TEXT_READER_TOKEN.encode()


class TextStreamGate:
    """The text stream's token and handler (none until ``serve``), and the check of a
    connection that asks for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: tuple[bytes, TextHandler] | None = None
        self._keyed: dict[str, int] = {}  # keyed readers being served, by peer address

    def serve(self, token: str, handler: TextHandler) -> None:
        if not token:
            raise ValueError("text-stream token must not be empty")
        with self._lock:
            self._served = (token.encode(), handler)

    def handle(self, sock: socket.socket, peer: str, token: bytes) -> bool:
        """Check ``token``, then run the handler in this thread until it returns. False:
        the caller closes the socket (always, refused or served)."""
        with self._lock:
            served = self._served
        if served is None:
            log.warning("text stream: rejected connection from %s: this node serves none", peer)
            answer(sock, ANSWER_REJECT, "this node serves no text stream")
            return False
        keyed = token == _READER
        address = _address(peer)
        if keyed:
            with self._lock:
                full = (
                    sum(self._keyed.values()) >= MAX_KEYED_READERS
                    or self._keyed.get(address, 0) >= MAX_KEYED_PER_PEER
                )
                if not full:
                    self._keyed[address] = self._keyed.get(address, 0) + 1
            if full:  # a busy node, not a refusal: the reader tries again a little later
                answer(sock, ANSWER_RETRY, "too many keyed readers: try again")
                return False
        elif not hmac.compare_digest(token, served[0]):
            log.warning("text stream: authentication failed: wrong token from %s", peer)
            answer(sock, ANSWER_REJECT, "authentication failed: wrong text-stream token")
            return False
        try:
            answer_ok(sock)
            sock.settimeout(None)
            served[1](sock, peer, keyed)
        except OSError as e:
            log.debug("text stream to %s ended: %s", peer, e)
        finally:
            if keyed:
                with self._lock:
                    left = self._keyed[address] - 1
                    if left:
                        self._keyed[address] = left
                    else:
                        del self._keyed[address]
        return False  # closed by the handshake's own clean-up


def _address(peer: str) -> str:
    """The host part of ``host:port`` (a peer's connections share its address)."""
    host, sep, _ = peer.rpartition(":")
    return host if sep else peer
