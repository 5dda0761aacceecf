"""The data plane's transport errors: what a caller of an edge catches, by what it means."""

from __future__ import annotations

__all__ = ["EdgeAuthError", "EdgeClosed", "EdgeError", "EdgeTimeout"]


class EdgeError(Exception):
    """Transport-level failure of an edge (a run fault per DECISIONS 14)."""


class EdgeTimeout(EdgeError, TimeoutError):
    """A read (or connect/send) missed its deadline.

    `partial` is False when nothing of the next record had arrived: the edge is still in
    sync and the caller may wait again (e.g. an idle stage between prompts). When True the
    edge has been closed (the stream cannot be resynchronised).
    """

    def __init__(self, message: str, *, partial: bool = False) -> None:
        super().__init__(message)
        self.partial = partial


class EdgeClosed(EdgeError):
    """The peer closed/reset the connection, or this end was closed locally."""


class EdgeAuthError(EdgeError):
    """The accepting side refused the hello (wrong token, duplicate edge, bad hello)."""
