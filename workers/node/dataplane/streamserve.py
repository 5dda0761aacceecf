"""A node's own datastream on the data-plane port (DECISIONS 93): a connection whose hello
names the reserved edge id (mvp_core.edge_auth.NODE_DATASTREAM_EDGE_ID) with the node's
datastream token is handed to the node's publisher (workers/node/nodestream.py), at most
MAX_FOLLOWERS at once; any other token is refused by name and logged."""

from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Callable

from mvp_core.edge_auth import ANSWER_REJECT, ANSWER_RETRY

from .endpoint import log
from .handshake import answer, answer_ok

__all__ = ["DatastreamGate", "DatastreamHandler"]

DatastreamHandler = Callable[[socket.socket, str], None]
MAX_FOLLOWERS = 4  # the run's datastream activity (one per attempt), and a spare


class DatastreamGate:
    """The node datastream's token and handler (none until ``serve``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: tuple[bytes, DatastreamHandler] | None = None
        self._following = 0

    def serve(self, token: str, handler: DatastreamHandler) -> None:
        if not token:
            raise ValueError("node datastream token must not be empty")
        with self._lock:
            self._served = (token.encode(), handler)

    def handle(self, sock: socket.socket, peer: str, token: bytes) -> bool:
        """Check ``token``, then run the handler in this thread until it returns. False:
        the caller closes the socket (always, refused or served)."""
        with self._lock:
            served = self._served
        if served is None:
            log.warning("node datastream: rejected connection from %s: none served", peer)
            answer(sock, ANSWER_REJECT, "this node serves no datastream")
            return False
        if not hmac.compare_digest(token, served[0]):
            log.warning("node datastream: authentication failed: wrong token from %s", peer)
            answer(sock, ANSWER_REJECT, "authentication failed: wrong datastream token")
            return False
        with self._lock:
            full = self._following >= MAX_FOLLOWERS
            if not full:
                self._following += 1
        if full:
            answer(sock, ANSWER_RETRY, "too many datastream followers: try again")
            return False
        try:
            answer_ok(sock)
            served[1](sock, peer)
        except OSError as e:
            log.debug("node datastream to %s ended: %s", peer, e)
        finally:
            with self._lock:
                self._following -= 1
        return False  # closed by the handshake's own clean-up
