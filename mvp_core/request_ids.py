"""Request ids: every one a JavaScript-safe integer.

The Temporal CLI and the Web UI read JSON numbers as JavaScript doubles, which hold
integers exactly only up to 2^53 - 1: past it, different ids show as the same number
(three prompts once showed as ``38479839030018050``). ``SubmitPrompt`` refuses a larger
id, and the clients that mint ids (the gateway, the host's prompt RPC) mint them here.
"""

from __future__ import annotations

import secrets

MAX_REQUEST_ID = 2**53 - 1  # Number.MAX_SAFE_INTEGER
BLOCK_BITS = 16  # ids a client counts through from its random start before it nears another's
_START_BITS = 53 - BLOCK_BITS - 1  # the random high bits: a start of at most 2^52


def request_id_problem(value: int) -> str | None:
    """Why ``value`` cannot be a request id, or None."""
    if value < 0:
        return f"request_id must be 0 or more, not {value}"
    if value > MAX_REQUEST_ID:
        return (
            f"request_id {value} is over {MAX_REQUEST_ID} (2^53 - 1): ids must be "
            "JavaScript-safe integers, or the Temporal CLI and Web UI show different "
            "prompts as the same number"
        )
    return None


class RequestIds:
    """Fresh request ids for one client: a random start (so two clients of one run all
    but surely never collide; a clash is a DuplicateRequestId the client retries), then
    counting up; never past ``MAX_REQUEST_ID`` (it wraps to 1)."""

    def __init__(self, start: int | None = None) -> None:
        if start is None:
            start = (secrets.randbits(_START_BITS) << BLOCK_BITS) or 1
        problem = request_id_problem(start)
        if problem is not None:
            raise ValueError(problem)
        self._next = start

    def __next__(self) -> int:
        value = self._next
        self._next = value + 1 if value < MAX_REQUEST_ID else 1
        return value

    def __iter__(self) -> RequestIds:
        return self
