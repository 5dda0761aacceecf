"""The accepting side of the hello (mvp_core.edge_auth): read and check it, answer it.

Hello (connecting side): magic `MOH1`, edge_id u32 LE, token length u16 LE, token bytes.
Answer (accepting side): status u8 (0 ok, 1 edge not expected yet: retry, 2 rejected),
reason length u16 LE, reason UTF-8. On a non-zero status the accepting side closes.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable

from mvp_core.edge_auth import ANSWER, ANSWER_OK, ANSWER_REJECT, HELLO, HELLO_MAGIC, MAX_TOKEN_LEN

from .endpoint import log
from .sockets import recv_exact, tune

__all__ = ["answer", "answer_ok", "read_hello"]


def answer(sock: socket.socket, status: int, reason: str) -> None:
    """A refusal (or retry) and its reason; a peer already gone is not an error here."""
    data = reason.encode()[:1000]
    with contextlib.suppress(OSError):
        sock.sendall(ANSWER.pack(status, len(data)) + data)


def answer_ok(sock: socket.socket) -> None:
    """Accept the hello (raises OSError where the peer is gone)."""
    sock.sendall(ANSWER.pack(ANSWER_OK, 0))


def read_hello(
    sock: socket.socket, peer: str, deadline: float, closing: Callable[[], bool]
) -> tuple[int, bytes] | None:
    """The hello's edge id and token, or None (answered and logged: a bad magic or
    token length, an incomplete hello; not logged once ``closing()``)."""
    try:
        tune(sock)
        magic, edge_id, token_len = HELLO.unpack(recv_exact(sock, HELLO.size, deadline))
        if magic != HELLO_MAGIC:
            log.warning(
                "data plane: rejected connection from %s: bad hello magic %r (expected %r)",
                peer,
                magic,
                HELLO_MAGIC,
            )
            answer(sock, ANSWER_REJECT, f"bad hello magic {magic!r}")
            return None
        if not 0 < token_len <= MAX_TOKEN_LEN:
            log.warning(
                "edge %d: rejected connection from %s: edge token length %d not in 1..%d",
                edge_id,
                peer,
                token_len,
                MAX_TOKEN_LEN,
            )
            answer(sock, ANSWER_REJECT, f"edge token length {token_len} not allowed")
            return None
        token = recv_exact(sock, token_len, deadline)
    except (OSError, EOFError) as e:
        if not closing():
            log.warning("data plane: incomplete hello from %s: %s", peer, e)
        return None
    return edge_id, token
