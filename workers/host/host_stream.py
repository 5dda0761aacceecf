"""The host's own datastream (spec 7.14): its sinks (the frame archive when configured,
the live socket that ``mvp-follow`` attaches to), redaction of every secret the host
knows, and its own stdout/stderr lines copied into it."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import IO, Any

from mvp_core.datastream import LogStream, Redactor, host_stream_id
from mvp_core.host_config import HostConfig
from mvp_io.datastream import Datastream, FrameArchive, LiveSubscribers, Sink
from temporal.connect import TemporalConfigError, TemporalSettings
from workers import stdio
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
    terminal still sees them."""

    def __init__(self, stream: Datastream) -> None:
        self.stream = stream
        self._orig = (sys.stdout, sys.stderr)

    def install(self) -> None:
        # Behind SafeStreams: a terminal gone (a pipe nobody reads) never stops a shutdown.
        sys.stdout = _Tee(stdio.safe(self._orig[0]), self.stream, LogStream.STDOUT)
        sys.stderr = _Tee(stdio.safe(self._orig[1]), self.stream, LogStream.STDERR)

    def remove(self) -> None:
        for tee in (sys.stdout, sys.stderr):
            if isinstance(tee, _Tee):
                tee.flush_partial()
        sys.stdout, sys.stderr = self._orig


class _Tee:
    def __init__(self, inner: IO[str], stream: Datastream, which: LogStream) -> None:
        self._inner, self._stream, self._which = inner, stream, which
        self._partial = ""

    def write(self, text: str) -> int:
        self._inner.write(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._stream.stdio_line(self._which, line)
        return len(text)

    def flush(self) -> None:
        self._inner.flush()

    def flush_partial(self) -> None:
        if self._partial:
            self._stream.stdio_line(self._which, self._partial)
            self._partial = ""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
