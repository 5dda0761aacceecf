"""The frame archive (process spec 7.13, 8.12): a run's frames as JSON lines, appended
and flushed per record, and read back for tools and tests."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any, TextIO

from mvp_core.datastream import encode_frame_line
from mvp_io.datastream.sinks import DEFAULT_QUEUE_FRAMES, Sink


class FrameArchive(Sink):
    """The frame archive: one JSON object per line, appended and flushed per record.

    ``arrival_seq`` of the first new line is the number of lines already in the file (a
    last line without its newline is completed first and counted). Opening errors raise
    here, in the caller; a write error later counts the frame as dropped and goes on."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int = DEFAULT_QUEUE_FRAMES,
        name: str = "archive",
    ) -> None:
        super().__init__(name, capacity)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+b")  # the sink's thread owns it
        try:
            self._next_seq = self._count_lines()
        except BaseException:
            self._file.close()
            raise
        self._cond = threading.Condition(self._lock)
        self._write_errors = 0
        self._written = 0
        self._start(f"datastream-archive-{self.path.name}")

    def _count_lines(self) -> int:
        f = self._file
        f.seek(0)
        count = 0
        last = b""
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
        if last and last != b"\n":
            f.write(b"\n")  # complete a torn last line so the next record starts clean
            f.flush()
            count += 1
        return count

    @property
    def next_arrival_seq(self) -> int:
        with self._lock:
            return self._next_seq

    @property
    def written(self) -> int:
        with self._lock:
            return self._written

    def _note_queued(self) -> bool:
        self._cond.notify()
        return False

    def _wake(self) -> None:
        with self._lock:
            self._cond.notify()

    def _extra_drops(self) -> int:
        return self._write_errors

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._queue and not self._closing:
                        self._cond.wait()
                    if self._abandoned or (self._closing and not self._queue):
                        return
                for frame in self._take(256):
                    with self._lock:
                        if self._abandoned:
                            return
                        seq = self._next_seq
                    line = (encode_frame_line(frame, seq) + "\n").encode("utf-8")
                    try:
                        self._file.write(line)
                        self._file.flush()
                    except (OSError, ValueError):
                        with self._lock:
                            self._write_errors += 1
                        continue
                    with self._lock:
                        self._next_seq += 1
                        self._written += 1
        finally:
            with contextlib.suppress(OSError):
                self._file.close()


def read_frame_lines(text: str | TextIO) -> list[dict[str, Any]]:
    """Parse frame lines (an archive's text, or an open file): for tools and tests."""
    lines = text.splitlines() if isinstance(text, str) else text.read().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
