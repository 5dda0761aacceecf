"""Bounded waits on a condition: how a test waits for something to happen.

A test that sleeps for a fixed time and then looks bets that the machine was fast enough;
on a busy machine it loses. These poll a predicate instead, up to a deadline, and fail
with what they waited for and what they last saw. The predicate's truthy value is
returned (the snapshot, the line, the row that satisfied it); a predicate may also raise
to fail at once (a process that exited, a run that stopped).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

__all__ = ["eventually", "wait_until"]

T = TypeVar("T")

_SHOWN = 2000  # of the last value's repr in the failure


def _timed_out(
    what: str, timeout: float, last: object, detail: Callable[[], str] | None
) -> AssertionError:
    seen = repr(last)
    if len(seen) > _SHOWN:
        seen = seen[:_SHOWN] + "..."
    more = f"\n{detail()}" if detail is not None else ""
    return AssertionError(
        f"timed out after {timeout:g} s waiting for {what}; last seen: {seen}{more}"
    )


def wait_until(
    predicate: Callable[[], T],
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
    detail: Callable[[], str] | None = None,
) -> T:
    """Call ``predicate`` every ``interval`` s until it returns a truthy value (returned);
    ``AssertionError`` naming ``what`` and the last value once ``timeout`` s have passed,
    with ``detail()`` (a log's tail, say) after them where given."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last, detail)
        time.sleep(interval)


@overload
async def eventually(
    predicate: Callable[[], Awaitable[T | None]],
    *,
    timeout: float,
    what: str,
    interval: float = ...,
    detail: Callable[[], str] | None = ...,
) -> T: ...


@overload
async def eventually(
    predicate: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = ...,
    detail: Callable[[], str] | None = ...,
) -> T: ...


async def eventually(
    predicate: Callable[[], Any],
    *,
    timeout: float,
    what: str,
    interval: float = 0.2,
    detail: Callable[[], str] | None = None,
) -> Any:
    """As ``wait_until``, on the event loop: ``predicate`` may be a coroutine function
    (awaited each time) or a plain one; between calls the loop runs other tasks. Every
    0.2 s by default: a predicate here mostly asks Temporal (a query runs a workflow task
    on the worker), and a tighter poll loads the very machine the test waits on."""
    deadline = time.monotonic() + timeout
    while True:
        last: Any = predicate()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last, detail)
        await asyncio.sleep(interval)
