"""Follow a live datastream: ``mvp-follow ADDRESS`` or ``mvp-follow --run-id N``.

ADDRESS is what a ``LiveSubscribers`` listens on: ``127.0.0.1:<port>`` or
``unix:<path>`` (the host prints its own). ``--run-id N`` asks run ``mvp-run-N`` (through
Temporal: ``--address`` and the settings of docs/temporal-connection.md) where its
datastream is (DECISIONS 58): a running run's is followed live (from the worker's host:
the address is a loopback one); a closed run's frame archive is printed when this host
has it. Every frame from attach time on is printed as it arrives: by default the frame
line as the archive writes it (one JSON object per line), with ``--text`` as
``<channel> <payload>``. Ends when the stream closes (exit 0), on Ctrl-C (exit 0), or
when it cannot connect (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from mvp_io.datastream import parse_address

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


def read_archive(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """A frame archive's lines, parsed (a torn last line is skipped)."""
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            if line.strip():
                out.append(json.loads(line))
    return out


def print_archive(
    path: str | os.PathLike[str], out: TextIO, render: Callable[[str], str] | None
) -> int:
    printed = 0
    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.strip():
                out.write((render(line) if render else line) + "\n")
                printed += 1
    out.flush()
    return printed


class FollowError(Exception):
    """Why a run's datastream cannot be followed, in one line."""


async def locate(run_id: int, address: str | None, wait_s: float) -> tuple[Any, bool]:
    """(the run's DatastreamAddress, whether the run is closed), through Temporal."""
    from temporalio.client import WorkflowExecutionStatus

    from temporal.client import RunHandle
    from temporal.connect import TemporalSettings, connect

    settings = TemporalSettings.load().override(address)
    try:
        client = await connect(settings=settings)
    except RuntimeError as err:
        raise FollowError(f"cannot reach Temporal at {settings.address}: {err}") from None
    run = RunHandle(client, run_id)
    try:
        desc = await run.describe()
    except Exception as err:
        raise FollowError(f"no run {run.workflow_id}: {err}") from None
    closed = desc.status != WorkflowExecutionStatus.RUNNING
    found = await run.datastream(wait_s=0 if closed else wait_s)
    if found is None:
        raise FollowError(f"run {run.workflow_id} has no datastream (yet)")
    return found, closed


def follow_run(
    run_id: int,
    out: TextIO,
    *,
    address: str | None = None,
    connect_timeout_s: float = 5.0,
    render: Callable[[str], str] | None = None,
) -> int:
    """Follow run ``run_id``'s datastream live, or print a closed run's archive."""
    found, closed = asyncio.run(locate(run_id, address, connect_timeout_s))
    archive = Path(found.archive)
    if not closed:
        try:
            return follow(found.address, out, connect_timeout_s=connect_timeout_s, render=render)
        except OSError:
            if not archive.is_file():
                raise
            closed = True  # it closed meanwhile: its archive has it all
    if archive.is_file():
        return print_archive(archive, out, render)
    raise FollowError(
        f"run {run_id} is closed; its archive {archive} is on {found.host or 'its worker'}"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mvp-follow", description="Follow a live datastream.")
    p.add_argument("target", nargs="?", help="127.0.0.1:<port> or unix:<path>")
    p.add_argument(
        "--run-id",
        type=int,
        default=None,
        help="follow run mvp-run-<id>'s datastream (found through Temporal)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="Temporal frontend HOST:PORT with --run-id (default: $TEMPORAL_ADDRESS or "
        "the envconfig profile's; docs/temporal-connection.md)",
    )
    p.add_argument("--text", action="store_true", help="print '<channel> <payload>'")
    p.add_argument(
        "--connect-timeout", type=float, default=5.0, help="seconds to keep trying to connect"
    )
    return p


def main_with(argv: Sequence[str] | None, out: TextIO) -> int:
    p = parser()
    args = p.parse_args(argv)
    if (args.target is None) == (args.run_id is None):
        p.error("give an ADDRESS or --run-id N")
    render = render_text if args.text else None
    what = args.target or f"run {args.run_id}"
    try:
        if args.run_id is not None:
            follow_run(
                args.run_id,
                out,
                address=args.address,
                connect_timeout_s=args.connect_timeout,
                render=render,
            )
        else:
            follow(args.target, out, connect_timeout_s=args.connect_timeout, render=render)
    except KeyboardInterrupt:
        return 0
    except (OSError, ValueError, FollowError) as e:
        print(f"follow {what}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return main_with(argv, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
