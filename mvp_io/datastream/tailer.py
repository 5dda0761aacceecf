"""The log tailer: follows a node's log file and publishes its lines as log records of
the node's stream."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

from mvp_core.datastream import SOURCE_NODE_LOG, LogStream, node_log_channel, node_stream_id
from mvp_io.datastream.publisher import Datastream


class LogTailer:
    """Follows a node's log file from offset 0 and publishes each complete line as a log
    record on ``mvp.provisioning.logs.node.<node_id>.<stream>`` (source ``node_log``,
    stream ``mvp-node-<run_id>-<node_id>``).

    A missing file is waited for; a file that shrinks or is replaced is read again from
    its start. Each poll reads at most ``max_bytes_per_poll``; a line longer than
    ``max_line_bytes`` is cut into pieces of that size. On ``stop`` the tailer reads what
    is left (bounded), and a last line without its newline is published too."""

    def __init__(
        self,
        datastream: Datastream,
        path: str | os.PathLike[str],
        *,
        node_id: int,
        stream: LogStream | str = LogStream.STDOUT,
        poll_interval_s: float = 0.2,
        max_bytes_per_poll: int = 256 * 1024,
        max_line_bytes: int = 64 * 1024,
        stop_drain_polls: int = 64,
        start_offset: int = 0,
    ) -> None:
        self._ds = datastream
        self.path = Path(path)
        self.node_id = int(node_id)
        self.log_stream = LogStream(stream)
        self._channel = node_log_channel(self.node_id, self.log_stream)
        self._stream_id = node_stream_id(datastream.run_id, self.node_id)
        self._poll_interval_s = poll_interval_s
        self._max_bytes = max_bytes_per_poll
        self._max_line = max_line_bytes
        self._stop_drain_polls = stop_drain_polls
        self._file: Any = None
        self._ino: tuple[int, int] | None = None
        self._offset = 0
        # Where a tailer of an earlier attempt stopped: the first open of the file
        # resumes there (unless the file is shorter now, then from its start).
        self._resume_at = max(0, int(start_offset))
        self._partial = bytearray()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_lock = threading.Lock()
        self._finished = False
        self.lines_published = 0

    @property
    def offset(self) -> int:
        """Bytes of the file published so far (complete lines only): where a later tailer
        of the same file resumes (``start_offset``)."""
        with self._poll_lock:
            return max(self._offset - len(self._partial), self._resume_at)

    def start(self) -> LogTailer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"log-tailer-{self.node_id}", daemon=True
            )
            self._thread.start()
        return self

    def poll(self) -> int:
        """One bounded read: publish the complete lines found; returns how many."""
        with self._poll_lock:
            if self._finished:
                return 0
            return self._poll_once()[0]

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop following: drain what is there, publish a last unterminated line, close."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(max(0.0, timeout_s))
            if self._thread.is_alive():
                return
        self._finish()

    def __enter__(self) -> LogTailer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._poll_lock:
                    read = self._poll_once()[1] if not self._finished else 0
            except Exception:
                read = 0
            if read < self._max_bytes:  # caught up: wait; else go on reading at once
                self._stop.wait(self._poll_interval_s)
        self._finish()

    def _finish(self) -> None:
        with self._poll_lock:
            if self._finished:
                return
            self._finished = True
            try:
                for _ in range(self._stop_drain_polls):
                    if self._poll_once()[1] == 0:
                        break
            except Exception:
                pass
            if self._partial:
                self._emit(bytes(self._partial))
                self._partial.clear()
            self._close_file()

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        self._file, self._ino = None, None

    def _open(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return self._file is not None  # gone: keep reading what we hold open
        ino = (st.st_dev, st.st_ino)
        if self._file is not None and ino == self._ino:
            if st.st_size < self._offset:  # truncated: read it again from the start
                self._offset = 0
                self._partial.clear()
            return True
        if self._file is not None:  # replaced: the old file's unterminated line ends here
            if self._partial:
                self._emit(bytes(self._partial))
            self._close_file()
        try:
            self._file = open(self.path, "rb")  # kept open between polls
        except OSError:
            return False
        self._ino, self._offset = ino, 0
        if self._resume_at and st.st_size >= self._resume_at:
            self._offset = self._resume_at
        self._resume_at = 0
        self._partial.clear()
        return True

    def _poll_once(self) -> tuple[int, int]:
        """(lines published, bytes read)."""
        if not self._open():
            return 0, 0
        try:
            self._file.seek(self._offset)
            data: bytes = self._file.read(self._max_bytes)
        except OSError:
            return 0, 0
        if not data:
            return 0, 0
        self._offset += len(data)
        buf = self._partial
        buf += data
        count = 0
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            while nl - start > self._max_line:
                self._emit(bytes(buf[start : start + self._max_line]))
                start += self._max_line
                count += 1
            self._emit(bytes(buf[start:nl]))
            count += 1
            start = nl + 1
        while len(buf) - start > self._max_line:
            self._emit(bytes(buf[start : start + self._max_line]))
            start += self._max_line
            count += 1
        del buf[:start]
        return count, len(data)

    def _emit(self, raw: bytes) -> None:
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        self._ds.node_log(
            self.node_id,
            self.log_stream,
            raw.decode("utf-8", "replace"),
            source=SOURCE_NODE_LOG,
            stream_id=self._stream_id,
        )
        self.lines_published += 1
