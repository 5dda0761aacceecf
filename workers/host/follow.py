"""Follow a running host's live datastream: ``python -m workers.host.follow ADDRESS``.

ADDRESS is what the host's ``LiveSubscribers`` listens on: ``127.0.0.1:<port>`` or
``unix:<path>``. Every frame from attach time on is printed as it arrives: by default the
frame line as the archive writes it (one JSON object per line), with ``--text`` as
``<channel> <payload>``. Ends when the host closes the stream (exit 0), on Ctrl-C (exit
0), or when it cannot connect (exit 1). The host's ``--follow`` calls ``follow``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from workers.host.datastream import parse_address

_RECV = 64 * 1024


def render_text(line: str) -> str:
    """``<channel> <payload>``: the payload's text, or ``<n bytes>`` for binary ones."""
    try:
        frame = json.loads(line)
        payload = frame["payload"]
        if payload["encoding"] == "utf8":
            body = str(payload["value"])
        else:
            body = f"<{len(payload['value'])} bytes>"
        return f"{frame['channel']} {body}"
    except (ValueError, KeyError, TypeError):
        return line


def connect(address: str, timeout_s: float = 5.0) -> socket.socket:
    """Connect to a live datastream, retrying until ``timeout_s`` (the host may still be
    starting); the last error is raised."""
    family, sockaddr = parse_address(address)
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
            sock.connect(sockaddr)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def follow(
    address: str,
    out: TextIO,
    *,
    connect_timeout_s: float = 5.0,
    stop: threading.Event | None = None,
    render: Callable[[str], str] | None = None,
    limit: int | None = None,
) -> int:
    """Print every frame line from ``address`` to ``out`` (flushed per line) until the host
    closes the stream, ``stop`` is set or ``limit`` lines were printed. Returns the number
    of lines printed. Connection errors raise ``OSError``."""
    sock = connect(address, connect_timeout_s)
    printed = 0
    buf = bytearray()
    try:
        sock.settimeout(0.2 if stop is not None else None)
        while stop is None or not stop.is_set():
            try:
                data = sock.recv(_RECV)
            except TimeoutError:
                continue
            if not data:
                break
            buf += data
            start = 0
            while (nl := buf.find(b"\n", start)) >= 0:
                line = buf[start:nl].decode("utf-8", "replace")
                start = nl + 1
                out.write((render(line) if render else line) + "\n")
                printed += 1
                if limit is not None and printed >= limit:
                    out.flush()
                    return printed
            del buf[:start]
            out.flush()
    finally:
        with contextlib.suppress(OSError):
            sock.close()
    return printed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.host.follow", description="Follow a host's live datastream."
    )
    parser.add_argument("address", help="127.0.0.1:<port> or unix:<path>")
    parser.add_argument("--text", action="store_true", help="print '<channel> <payload>'")
    parser.add_argument(
        "--connect-timeout", type=float, default=5.0, help="seconds to keep trying to connect"
    )
    args = parser.parse_args(argv)
    try:
        follow(
            args.address,
            sys.stdout,
            connect_timeout_s=args.connect_timeout,
            render=render_text if args.text else None,
        )
    except KeyboardInterrupt:
        return 0
    except (OSError, ValueError) as e:
        print(f"follow {args.address}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
