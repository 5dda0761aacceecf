"""Terminal output that never stops a shutdown.

``demo … | tee demo.log``, and then the pipe's reader dies: every later write to stdout
raises ``BrokenPipeError`` (Python ignores SIGPIPE). A print on the way out must not
raise instead of stopping the run, so the host commands write through :class:`SafeStream`:
what cannot be written is dropped, and the rest of the process goes on. The programs'
own lines on stderr (``<prog>: <message>``) are :func:`sayer`'s, the same for every room
(the host's and the gateway's), which is why this module lives beside the rooms.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import IO, Any, cast


class SafeStream:
    """A text stream whose writes and flushes never raise ``OSError`` (a closed pipe, a
    full disk) or ``ValueError`` (a closed file): what cannot be written is dropped."""

    def __init__(self, inner: IO[str]) -> None:
        self._inner = inner
        self.broken = False  # a write or flush failed: the reader has gone

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                self._inner.write(text)
            except (OSError, ValueError):
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._inner.flush()
            except (OSError, ValueError):
                self.broken = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def safe(stream: IO[str]) -> IO[str]:
    """``stream`` behind a SafeStream (itself when it is one already)."""
    inner: object = stream
    if isinstance(inner, SafeStream):
        return stream
    return cast(IO[str], SafeStream(stream))


def install() -> None:
    """This process's stdout and stderr, from here on, behind SafeStreams."""
    sys.stdout = safe(sys.stdout)
    sys.stderr = safe(sys.stderr)


def sayer(prog: str) -> Callable[[str], None]:
    """``say(message)``: one line ``<prog>: <message>`` on this process's stderr as it is
    when called (a host's tee into its datastream included). A stderr nobody reads any
    more (``2>&1 | tee``, tee gone) drops it: a line that cannot be written never stops a
    shutdown."""

    def say(message: str) -> None:
        print(f"{prog}: {message}", file=safe(sys.stderr), flush=True)

    return say
