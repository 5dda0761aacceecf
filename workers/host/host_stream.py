"""The host's own datastream (spec 7.14): its sinks (the frame archive when configured,
the live socket that ``mvp-follow`` attaches to), redaction of every secret the host
knows, and its own stdout/stderr lines copied into it."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

from mvp_core.datastream import LogStream, Redactor, host_stream_id
from mvp_core.host_config import HostConfig
from mvp_io.datastream import Datastream, FrameArchive, LiveSubscribers, Sink
from temporal.connect import TemporalConfigError, TemporalSettings
from workers.host.exits import HostError

# Where a second process attaches to the live datastream (printed at start; ``--follow``
# of workers/host/follow.py): a unix socket in the host's state directory, mode 0600.
FOLLOW_SOCKET = "datastream.sock"


def host_secrets(cfg: HostConfig) -> list[str]:
    """What the datastream redacts beyond the environment's: the configuration's tokens
    and keys, and the Temporal API key (and other connection secrets) of a profile file."""
    secrets = [s.get_secret_value() for s in (cfg.hf_token,) if s is not None]
    if cfg.vastai is not None and getattr(cfg.vastai, "api_key", None) is not None:
        secrets.append(cfg.vastai.api_key.get_secret_value())
    with contextlib.suppress(TemporalConfigError):
        secrets += TemporalSettings.load().secrets()
    return secrets


def open_datastream(
    cfg: HostConfig, root: Path, secrets: list[str]
) -> tuple[Datastream, LiveSubscribers]:
    """The host's datastream and its live socket; HostError when a sink cannot open."""
    sinks: list[Sink] = []
    if cfg.datastream_frame_log is not None:
        try:
            sinks.append(FrameArchive(cfg.datastream_frame_log))
        except OSError as err:
            raise HostError(
                f"cannot open the frame archive {cfg.datastream_frame_log}: {err}"
            ) from None
    try:
        live = LiveSubscribers(f"unix:{root / FOLLOW_SOCKET}")
    except OSError as err:
        raise HostError(
            f"cannot open the datastream socket {root / FOLLOW_SOCKET}: {err}"
        ) from None
    sinks.append(live)
    stream = Datastream(
        run_id=cfg.run_id,
        node_id=0,
        sinks=sinks,
        redactor=Redactor.from_env(os.environ, extra=secrets),
        # The host's own records; the run's come forwarded on mvp-orchestrator-<run_id>.
        stream=host_stream_id(cfg.run_id),
    )
    return stream, live


class StdioCapture:
    """The host's own stdout/stderr lines also go to the datastream (spec 7.14); the
    terminal still sees them. Captured at the file descriptor (issue 38 item 6): fds 1
    and 2 become pipes that a thread each reads, copies to what they were (the terminal,
    a file, a pipe) and splits into lines, so native code's writes (C libraries, the
    Temporal SDK's core) and any child that shares them are in the datastream too, not
    only Python's ``print``."""

    def __init__(self, stream: Datastream) -> None:
        self.stream = stream
        self._tees: list[_FdTee] = []

    def install(self) -> None:
        for fd, which in ((1, LogStream.STDOUT), (2, LogStream.STDERR)):
            with contextlib.suppress(OSError, ValueError):
                (sys.stdout if fd == 1 else sys.stderr).flush()
            try:
                tee = _FdTee(fd, self.stream, which)
            except OSError:
                continue  # no such fd (a daemon's closed stdio): nothing to capture
            tee.start()
            self._tees.append(tee)

    def remove(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        for tee in self._tees:
            tee.restore()
        self._tees = []


MAX_LINE = 64 * 1024  # a longer run of bytes without a newline goes out as a line


class _FdTee(threading.Thread):
    """Fd ``fd`` made a pipe; its bytes copied to what the fd was, and its lines to the
    datastream."""

    def __init__(self, fd: int, stream: Datastream, which: LogStream) -> None:
        super().__init__(name=f"stdio-capture-{fd}", daemon=True)
        self._fd, self._stream, self._which = fd, stream, which
        self._saved = os.dup(fd)
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        self._read_end = read_end
        self._broken = False  # what the fd was is gone (a closed terminal): copy no more

    def run(self) -> None:
        partial = b""
        while True:
            try:
                data = os.read(self._read_end, 65536)
            except OSError:
                break
            if not data:
                break
            self._copy(data)
            lines = (partial + data).split(b"\n")
            partial = lines.pop()
            if len(partial) > MAX_LINE:
                lines.append(partial)
                partial = b""
            for line in lines:
                self._publish(line)
        if partial:
            self._publish(partial)

    def _publish(self, line: bytes) -> None:
        # Never raises: this thread dying would leave the fd a pipe nobody reads, and the
        # host's next writes blocked on it.
        with contextlib.suppress(Exception):
            self._stream.stdio_line(self._which, line.decode(errors="replace"))

    def _copy(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self._broken:
            try:
                view = view[os.write(self._saved, view) :]
            except OSError:
                self._broken = True  # as SafeStream: a reader gone never stops the host

    def restore(self) -> None:
        """The fd is what it was again (the pipe's write end closes with it): the thread
        reads to the pipe's end (bounded: a child that shares the fd keeps it open)."""
        with contextlib.suppress(OSError):
            os.dup2(self._saved, self._fd)
        self.join(timeout=2.0)
        if not self.is_alive():
            with contextlib.suppress(OSError):
                os.close(self._read_end)
        with contextlib.suppress(OSError):
            os.close(self._saved)
